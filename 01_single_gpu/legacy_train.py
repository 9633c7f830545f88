"""Single-device training: the reference every parallel folder must reproduce.

Playbook §2.1 (anatomy of a training step, gradient accumulation, activation recomputation,
mixed precision). One optimizer step:

    for each of grad_acc micro-batches:  loss = model(x, y) / grad_acc;  loss.backward()
    clip the gradient norm;  AdamW step (fp32 master weights);  zero the gradients

Gradient accumulation averages (does not sum) the micro-batch gradients, so
global batch = mbs · grad_acc (· dp later) sequences and the result does not depend on the split.
MFU counts 6·N FLOPs per token for the matmul parameters (2N forward, 4N backward) plus
12·L·h·s for the attention scores (the full s×s matrix, as PaLM counts it), not the recomputed ones.

    python 01_single_gpu/train.py --steps 200                  # the tiny Llama on Python's own sources
    python 01_single_gpu/train.py --mbs 2 --grad-acc 4 --recompute selective --json-log run.jsonl

Later folders reuse `train()` and change one thing each through a `TrainPlan`.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere; folders import by dotted name

import contextlib
import os
import math
import time
from dataclasses import dataclass, field
from importlib import import_module
from typing import Callable

import torch
from tqdm import tqdm

cli = import_module("01_single_gpu.cli")
data = import_module("01_single_gpu.data")
hf_io = import_module("01_single_gpu.hf_io")
checkpoint = import_module("01_single_gpu.checkpoint")
loop = import_module("01_single_gpu.loop")
memory = import_module("01_single_gpu.memory")
metrics = import_module("01_single_gpu.metrics")
optim = import_module("01_single_gpu.optim")
watchdog = import_module("01_single_gpu.watchdog")
recompute = import_module("01_single_gpu.recompute")
modeling = import_module("01_single_gpu.model")

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}   # dense bf16, per GPU


def forward_backward(model, micro_batches):
    """Accumulate the gradients of the mean loss over the micro-batches; return that loss."""
    total = 0.0
    for x, y in micro_batches:                                   # x, y: (mbs, T)
        loss = model(x, labels=y) / len(micro_batches)
        loss.backward()
        total += loss.detach()
    return total


def clip_gradients(params, max_norm):
    return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))


def flops_per_token(config, seq_len):
    """6 FLOPs per matmul parameter (forward 2, backward 4) plus causal attention's 12·L·h·s."""
    with torch.device("meta"):   # shapes only: no memory, no initialisation (the 1b preset would take seconds)
        shapes = modeling.LlamaForCausalLM(config)
    matmul_params = sum(p.numel() for n, p in shapes.named_parameters()
                        if "embed_tokens" not in n or config.tie_word_embeddings)
    return 6 * matmul_params + 12 * config.num_hidden_layers * config.hidden_size * seq_len


@dataclass
class TrainPlan:
    """What a parallel folder changes in the loop; the defaults are one device."""
    dp_rank: int = 0                       # which rows of each global batch this rank reads
    dp_size: int = 1
    is_logging_rank: bool = True           # prints, writes --json-log and the progress bar
    forward_backward: Callable = forward_backward     # (model, micro_batches) -> this rank's mean loss
    finish_gradients: Callable = lambda: None         # after the last micro-batch: synchronise gradients
    clip_gradients: Callable = clip_gradients         # (params, max_norm) -> global gradient norm
    global_loss: Callable = lambda loss: float(loss)  # this rank's loss -> the loss of the global batch
    layout: dict = field(default_factory=dict)        # parallel degrees, checked on --resume
    world_size: int = 1                    # devices that share the work (for MFU)
    flops_per_token: Callable = flops_per_token       # (config, seq_len) -> model FLOPs per token (for MFU)


def device_of(args):
    if args.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def param_dtype(args):  # bfloat16 trains fp32 master weights under bf16 autocast
    return torch.float64 if args.dtype == "float64" else torch.float32


def lr_at(step, args):
    """Linear warmup to --lr, then cosine decay to lr·min_lr_ratio at step --lr-decay-steps (default:
    the last step), and lr·min_lr_ratio after it."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    decay_steps = args.lr_decay_steps or args.steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, decay_steps - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def load_data(args):
    tokenizer = data.load_tokenizer(args.tokenizer)
    return tokenizer, data.build_dataset(args.dataset, tokenizer, args.seq_len, text_column=args.text_column)


def build_model(args, config):
    """The full model, seeded identically in every folder (later folders slice it per rank)."""
    torch.manual_seed(args.seed)
    model = modeling.LlamaForCausalLM(config).to(param_dtype(args))
    if args.init_from:
        hf_io.load_hf_into(model, args.init_from)
    if (args.kernels, args.attn) != ("torch", "sdpa"):
        import_module("kernels.patch").apply_kernels(model, args.kernels, args.attn)
    return model


def decays(p) -> bool:
    """Weight decay applies to the matrices and the embedding (2-D), not to the RMSNorm gains (1-D):
    nanoGPT's and Megatron's rule, since shrinking a gain only rescales its layer. A ZeRO shard is a
    flat 1-D piece of several parameters: it says what it holds through a `decays` attribute."""
    return getattr(p, "decays", p.dim() >= 2)


def make_optimizer(params, args):
    """AdamW (β = 0.9, 0.95, as Llama) with decoupled weight decay on the parameters `decays` picks."""
    params = list(params)
    groups = [{"params": [p for p in params if decays(p)], "weight_decay": args.weight_decay},
              {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def train(args, model, optimizer, plan: TrainPlan, dataset, config):
    """The loop every folder runs. Returns the list of per-step records (also --json-log)."""
    device = device_of(args)
    params = [p for p in model.parameters() if p.requires_grad]
    sampler = data.GlobalBatchSampler(dataset, args.seed, args.mbs, args.grad_acc, plan.dp_size)
    start = 0
    if args.resume:   # the checkpoint cli.parse_args chose and checked: the same run, the same layout
        start = checkpoint.load_checkpoint(args.checkpoint_dir, model, optimizer, plan.layout, args.resume_step)
    args.lr_decay_steps = args.lr_decay_steps or args.steps
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16"
                else contextlib.nullcontext())
    tokens_per_step = sampler.global_batch * args.seq_len
    flops = plan.flops_per_token(config, args.seq_len) * tokens_per_step
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items()
                                     if device.type == "cuda" and k in torch.cuda.get_device_name(device)), None)
    log = (metrics.open_json_log(args.json_log, start, args.resume) if args.json_log and plan.is_logging_rank
           else None)
    bar = tqdm(total=args.steps, initial=start, disable=not plan.is_logging_rank or args.no_progress,
               desc="train", dynamic_ncols=True)
    guard = optim.SkipNonFinite(optimizer) if args.on_nonfinite == "skip" else None
    several = plan.world_size > 1 and torch.distributed.is_initialized()
    dog = watchdog.Watchdog(args.timeout_s, torch.distributed.get_rank()) if several else None
    records = []
    with dog or contextlib.nullcontext():
        for step in range(start, args.steps):
            t0 = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args)
            micro_batches = [tuple(t.to(device) for t in sampler.micro_batch(step, m, plan.dp_rank))
                             for m in range(args.grad_acc)]
            # The first step of the run follows what autograd saves for backward: its peak is the
            # measured activation memory (the setup table shows Korthikanti's estimate).
            activation_meter = memory.saved_activation_bytes(exclude=params) if step == start else None
            with autocast, activation_meter or contextlib.nullcontext():
                loss = plan.forward_backward(model, micro_batches)
            plan.finish_gradients()
            grad_norm = plan.clip_gradients(params, args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = plan.global_loss(loss)
            if device.type == "cuda":
                torch.cuda.synchronize(device)   # honest step times on an asynchronous device
            dt = time.perf_counter() - t0
            record = {"step": step + 1, "loss": loss, "lr": lr_at(step, args), "grad_norm": float(grad_norm),
                      "tokens_per_s": tokens_per_step / dt,
                      "mfu": flops / dt / (peak * 1e12 * plan.world_size) if peak else None}
            skipped = guard is not None and guard.skipped
            if skipped:
                record["skipped"] = True
            records.append(record)
            if log:
                log.write(metrics.json_line(record))
                log.flush()
            if not (skipped or loop.finite(loss, grad_norm)):
                bar.close()
                loop.stop_nonfinite(step, loss, grad_norm, guard is not None)
            if plan.is_logging_rank and (step + 1) % args.log_every == 0:
                mem = f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f}GiB" if device.type == "cuda" else "-"
                mfu = f"{record['mfu']:.1%}" if peak else "n/a"
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", mfu=mfu, mem=mem)
                if args.no_progress:
                    print(f"step {step + 1:>5} | loss {loss:.4f} | lr {record['lr']:.2e} | "
                          f"tok/s {record['tokens_per_s']:.0f} | mfu {mfu} | mem {mem}", flush=True)
            if plan.is_logging_rank and skipped:
                bar.write(f"step {step + 1}: loss {loss}, gradient norm {float(grad_norm)}: skipped "
                          f"(--on-nonfinite skip: parameters and optimizer state unchanged)")
            if activation_meter and plan.is_logging_rank:
                bar.write(f"activations saved for backward in step {step + 1}, measured on this rank: peak "
                          f"{activation_meter.peak / 2**20:.2f} MiB (the memory table's line is the estimate)")
            bar.update(1)
            if args.checkpoint_dir and (step + 1 == args.steps or
                                        (args.checkpoint_every and (step + 1) % args.checkpoint_every == 0)):
                checkpoint.save_checkpoint(args.checkpoint_dir, step + 1, model, optimizer,
                                           {"layout": plan.layout, "global_batch": sampler.global_batch,
                                            "args": vars(args)}, args.keep_last, args.overwrite)
            if dog:
                dog.beat(f"step {step + 1} ended")
    if guard:
        guard.remove()
    bar.close()
    if log:
        log.close()
    return records


def print_setup(args, config, model, optimizer, activations, title="memory per rank", plan=None):
    if plan is None or plan.is_logging_rank:
        n = sum(p.numel() for p in model.parameters())
        print(f"model: {n / 1e6:.2f}M parameters, {config}")
        grad_dtype = torch.float32 if args.dtype == "bfloat16" else None
        print(memory.memory_report(model.parameters(), optimizer, activations, grad_dtype).table(title))


def run(args):
    """Train on one device; returns (per-step records, trained model)."""
    tokenizer, dataset = load_data(args)
    config = cli.model_config(args, tokenizer.vocab_size)
    model = build_model(args, config).to(device_of(args))
    recompute.apply_recompute(model, args.recompute)
    optimizer = make_optimizer(model.parameters(), args)
    element = 2 if args.dtype == "bfloat16" else torch.empty(0, dtype=param_dtype(args)).element_size()
    print_setup(args, config, model, optimizer,
                memory.activation_bytes_estimate(config, args.mbs, args.seq_len, element, args.recompute))
    records = train(args, model, optimizer, TrainPlan(), dataset, config)
    if records:
        print(f"final loss {records[-1]['loss']:.4f} after {records[-1]['step']} steps")
    return records, model


def main(argv=None):
    return run(cli.parse_args(cli.core_parser(__doc__.splitlines()[0]), argv))[0]


if __name__ == "__main__":
    main()
