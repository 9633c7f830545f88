"""What a run reports per step: loss, learning rate, gradient norm, tokens/s, MFU, HFU (plumbing).

MFU (playbook §2.1 "MFU and HFU", PaLM App. B): model FLOPs per second over the devices' peak. The model
FLOPs per token are 6 per matmul parameter (2 forward, 4 backward) plus 12·L·h·s for the causal attention
scores (the full s×s matrix, as PaLM counts it). HFU counts what the hardware really ran: the recomputed
forward too (`hardware_flops_per_token`: full recompute adds one forward of the layers, their 6 → 8 per
parameter and 12 → 16·L·h·s, i.e. 4/3 of the layers' FLOPs; selective adds the attention core's 4·L·h·s).
A trainer whose token does not pass through every parameter (07's MoE) gives its own count.

`StepLog` is the one place that prints: a tqdm bar (or one line per step with --no-progress), and
--json-log PATH with one JSON object per step ({"step", "loss", "lr", "grad_norm", "tokens_per_s",
"mfu", "hfu"}, "eval_loss" after an evaluation, "skipped": true for a step --on-nonfinite skip or an fp16
overflow skipped, and "loss_scale" under --dtype float16), written by the logging rank only; --tensorboard
DIR gets the same scalars and the memory (GiB: the GPU allocator's peak, or the process's peak RSS on the
CPU) through torch.utils.tensorboard. Every line is strict JSON (a NaN or inf is written as null), and a
resumed run first drops the lines after its checkpoint's step, so the file holds each step once.
`profiler` is --profile DIR's torch.profiler.
"""
import contextlib
import json
import math
import os
import resource
import time
from pathlib import Path

import torch
from tqdm import tqdm

import model as modeling

PROFILE_ACTIVE = 3                                             # steps --profile records
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}   # dense bf16, per GPU


def flops_per_token(config, seq_len: int) -> int:
    """6 FLOPs per matmul parameter (forward 2, backward 4) plus causal attention's 12·L·h·s."""
    # exercise 01.6: MFU's and HFU's FLOPs per token
    # hint: [PB] §2.1 "MFU and HFU", PaLM App. B (01's README, "Derivations"; its Reference, "HFU against
    #   MFU"): count the parameters a token multiplies from the model's shapes (built on the meta device:
    #   no memory, no initialisation); the embedding is a lookup, unless the head shares its weight; QKᵀ
    #   and AV add per token what the docstring says; HFU adds what recomputation runs again.
    # test: tests/test_single_gpu.py::test_mfu_and_hfu_flops_per_token_written_out_from_the_shapes
    # shapes only: no memory, no initialisation (the 1b preset would take seconds)
    with torch.device("meta"):
        shapes = modeling.LlamaForCausalLM(config)
    matmul_params = sum(p.numel() for n, p in shapes.named_parameters()
                        if "embed_tokens" not in n or config.tie_word_embeddings)
    return 6 * matmul_params + 12 * config.num_hidden_layers * config.hidden_size * seq_len
    # end exercise


def hardware_flops_per_token(model_flops: int, config, seq_len: int, recompute: str) -> int:
    """HFU's count: `model_flops` (flops_per_token's, or 07's MoE count) plus what --recompute runs again
    (Korthikanti et al. §5, Megatron's 72 → 96·B·s·L·h² for full recompute):
        full       + one forward of every layer: a third of the layers' share (everything but the head)
        selective  + the attention core's forward, q·kᵀ and softmax·v: 2·h·s + 2·h·s per layer"""
    if recompute == "full":
        # exercise 01.6
        with torch.device("meta"):
            shapes = modeling.LlamaForCausalLM(config)
        head = sum(p.numel() for n, p in shapes.named_parameters()      # the final norm and the lm head
                   if not n.startswith("model.layers.")
                   and ("embed_tokens" not in n or config.tie_word_embeddings))
        return model_flops + (model_flops - 6 * head) // 3                # layers: 6 → 8 per parameter
        # end exercise
    if recompute == "selective":
        # exercise 01.6
        return model_flops + 4 * config.num_hidden_layers * config.hidden_size * seq_len
        # end exercise
    return model_flops


def peak_tflops(args, device):
    """--peak-tflops, else the known GPU's dense bf16 peak, else None (MFU is then not shown)."""
    if args.peak_tflops:
        return args.peak_tflops
    if device.type != "cuda":
        return None
    return next((v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name(device)), None)


def json_line(record: dict) -> str:
    """A record as one line of strict JSON: NaN and inf (which json.dumps would write bare) become null."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                       for k, v in record.items()}, allow_nan=False) + "\n"


def open_json_log(path, start: int, resume: bool):
    """--json-log, ready to append the records of the steps after `start`. A resumed run keeps the lines of
    steps up to its checkpoint and drops the rest: the steps the run before logged after that checkpoint
    (they are run again) and a line torn by a crash. The new file replaces the old whole, or not at all."""
    path = Path(path)
    if not (resume and path.is_file()):   # not a device such as /dev/null: it is not read back
        return open(path, "w")
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= start:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    scratch = path.with_name(path.name + ".tmp")
    try:
        scratch.write_text("".join(kept))
    except OSError:
        scratch.unlink(missing_ok=True)        # a full disk: the old log stays as it was
        raise
    os.replace(scratch, path)
    return open(path, "a")


class StepLog:
    """Times each step and reports it; `records` keeps what was logged (tests and callers read it).
    A --json-log write that fails (a full disk) stops the writing and leaves its line in `failure`: the loop
    then stops every rank after the step without saving it (--resume runs it, and logs it, again)."""

    def __init__(self, args, start: int, tokens_per_step: int, flops_per_step: float, world_size: int,
                 device, is_logging_rank: bool, hardware_flops_per_step: float | None = None):
        self.args, self.device, self.is_logging_rank = args, device, is_logging_rank
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.world_size = world_size
        self.hardware_flops_per_step = hardware_flops_per_step or flops_per_step   # recomputed FLOPs included
        self.peak = peak_tflops(args, device)
        self.records, self.json, self.failure = [], None, None
        if args.json_log and is_logging_rank:
            try:
                self.json = open_json_log(args.json_log, start, args.resume)
            except OSError as error:
                self.failed("rewriting it for --resume", error)
        self.tensorboard = None
        if args.tensorboard and is_logging_rank:
            from torch.utils.tensorboard import SummaryWriter   # needs `pip install tensorboard` (cli checks)
            self.tensorboard = SummaryWriter(args.tensorboard, purge_step=start + 1 if args.resume else None)
        self.eval_loss = None
        self.bar = tqdm(total=args.steps, initial=start, disable=not is_logging_rank or args.no_progress,
                        desc="train", dynamic_ncols=True)
        self.t0 = time.perf_counter()

    def start_step(self):
        self.t0 = time.perf_counter()

    def end_step(self, step: int, loss: float, lr: float, grad_norm, skipped: bool = False, extra=None,
                 evaluate=None) -> dict:
        """Log the step. `evaluate()` (the held-out loss) runs after the clock stopped (tokens/s: train)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # honest step times on an asynchronous device
        seconds = time.perf_counter() - self.t0
        peak = self.peak * 1e12 * self.world_size if self.peak else None      # FLOP/s of all the devices
        record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
                  "tokens_per_s": self.tokens_per_step / seconds,
                  "mfu": self.flops_per_step / seconds / peak if peak else None,
                  "hfu": self.hardware_flops_per_step / seconds / peak if peak else None}
        if evaluate is not None:
            record["eval_loss"] = self.eval_loss = evaluate()
        if skipped:
            record["skipped"] = True
        record.update(extra or {})
        self.records.append(record)
        if self.json:
            self.write_json(record)
        if self.tensorboard:
            self.write_tensorboard(record)
        if self.is_logging_rank and (step + 1) % self.args.log_every == 0:
            mem = (f"{torch.cuda.max_memory_allocated(self.device) / 2**30:.1f}GiB"
                   if self.device.type == "cuda" else "-")
            mfu, hfu = (f"{record[k]:.1%}" if self.peak else "n/a" for k in ("mfu", "hfu"))
            shown = {} if self.eval_loss is None else {"eval": f"{self.eval_loss:.4f}"}   # the latest one
            self.bar.set_postfix(loss=f"{loss:.4f}", **shown, tok_s=f"{record['tokens_per_s']:.0f}", mfu=mfu,
                                 hfu=hfu, mem=mem)
            if self.args.no_progress:
                evaluated = f" | eval {record['eval_loss']:.4f}" if "eval_loss" in record else ""
                print(f"step {step + 1:>5} | loss {loss:.4f}{evaluated} | lr {lr:.2e} | "
                      f"tok/s {record['tokens_per_s']:.0f} | mfu {mfu} | hfu {hfu} | mem {mem}", flush=True)
        self.bar.update(1)
        return record

    def write_json(self, record: dict):
        """One line of --json-log."""
        try:
            self.json.write(json_line(record))
            self.json.flush()
        except OSError as error:
            self.failed(f"writing step {record['step']}'s record", error)

    def failed(self, what: str, error: OSError):
        """A --json-log write failed: no more are tried, and `failure` holds the line the run ends with."""
        with contextlib.suppress(OSError, AttributeError):   # close() flushes again: the record is lost
            self.json.close()
        self.json = None
        self.failure = (f"--json-log {self.args.json_log}: {what} failed ({error.strerror}): free space "
                        f"there or pass another --json-log; the checkpoints saved so far are intact "
                        f"(--resume continues from the last one)")

    def write_tensorboard(self, record: dict):
        """The record's scalars under train/ and eval/, and the memory in GiB, at its step."""
        step = record["step"]
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "hfu"):
            if record[key] is not None:
                self.tensorboard.add_scalar(f"train/{key}", record[key], step)
        if "eval_loss" in record:
            self.tensorboard.add_scalar("eval/loss", record["eval_loss"], step)
        if self.device.type == "cuda":
            self.tensorboard.add_scalar("memory/gpu_peak_allocated_gib",
                                        torch.cuda.max_memory_allocated(self.device) / 2**30, step)
        else:   # Linux reports ru_maxrss in KiB
            self.tensorboard.add_scalar("memory/peak_rss_gib",
                                        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, step)

    def write(self, line: str):
        """A line from the logging rank that does not break the bar."""
        if self.is_logging_rank:
            self.bar.write(line)

    def close(self):
        self.bar.close()
        if self.json:
            self.json.close()
        if self.tensorboard:
            self.tensorboard.close()


def profiler(folder, device, rank: int):
    """--profile DIR: the playbook's torch.profiler recipe (§2.1 "profiling"): skip 1 step, warm up 1, record
    the next 3, then write a Chrome trace `rank{r}.*.pt.trace.json` into DIR, which opens in Perfetto
    (ui.perfetto.dev), chrome://tracing or TensorBoard's profiler plugin. None without DIR. The loop calls
    `.step()` after each optimizer step; a run that ends inside the recorded window writes what it has."""
    if folder is None:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":            # the kernels too (written for GPUs, untested on one here)
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=PROFILE_ACTIVE, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(folder), worker_name=f"rank{rank}"),
        record_shapes=True, with_stack=False)
