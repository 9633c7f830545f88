"""Single-device training: the reference every parallel folder must reproduce.

Playbook §2.1 (anatomy of a training step, gradient accumulation, activation recomputation, mixed
precision). One optimizer step, `train_step` below:

    zero the gradients
    for each of grad_acc micro-batches:  loss = model(x, y) / grad_acc;  (loss · S).backward()
    unscale (÷ S), clip the gradient norm;  AdamW step on the fp32 master weights

Gradient accumulation averages (does not sum) the micro-batch gradients, so global batch = mbs · grad_acc
(· dp later) sequences and the result does not depend on the split. Around the step, the plumbing in
runtime/ does the rest for every folder: cli.py (flags), build.py (device, data, seeded model), loop.py
(LR schedule, batches, logging, checkpoints). Beside it: metrics.py (MFU), memory.py (the memory table),
and mixed_precision.py the dtypes (--dtype, --precision-layout; S is fp16's loss scale, 1 otherwise).

    python 01_single_gpu/train.py --steps 200                  # the tiny Llama on Python's own sources
    python 01_single_gpu/train.py --mbs 2 --grad-acc 4 --recompute selective --json-log run.jsonl
    python 01_single_gpu/train.py --dtype bfloat16 --precision-layout bf16-20 --grad-acc 4
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime")]

import functools

import build
import cli
import loop
import memory
import mixed_precision
import metrics
import optim
import recompute


def train_step(model, optimizer, micro_batches, args):
    """One optimizer step on one device; returns (the global batch's mean loss, the gradient norm)."""
    optimizer.zero_grad(set_to_none=True)
    loss = 0.0
    with mixed_precision.autocast(args, micro_batches[0][0].device):
        for x, y in micro_batches:                              # x, y: (mbs, T)
            micro_loss = model(x, labels=y) / len(micro_batches)   # the mean over the global batch
            # the gradients accumulate in .grad (bf16-20: in fp32 buffers); fp16: backward of S·loss
            optimizer.scale(micro_loss).backward()
            loss += micro_loss.detach()
    grad_owners = optimizer.unscale_gradients()                 # fp16: ÷ S; bf16-20: the fp32 masters
    grad_norm = optim.clip_grad_norm(grad_owners, args.grad_clip)  # summed in fp32 (bf16-16 too)
    optimizer.step(grad_norm)                                   # fp32 masters; fp16 overflow: skipped
    return float(loss), grad_norm


def run(args, config, dataset):
    """Train on one device; returns (per-step records, trained model)."""
    model = build.materialize(build.build_model(args, config), args)      # built on meta, then given values
    recompute.apply_recompute(model, args.recompute)
    optimizer = mixed_precision.MixedPrecisionOptimizer(model.parameters(), args)   # AdamW on fp32 masters
    activations = memory.activation_bytes_estimate(config, args.mbs, args.seq_len,
                                                   build.activation_element_bytes(args), args.recompute)
    memory.print_report(model, optimizer, activations, args, config)
    records = loop.train(args, functools.partial(train_step, model, optimizer, args=args), model, optimizer,
                         dataset, metrics.flops_per_token(config, args.seq_len),
                         eval_step=lambda micro_batches: float(loop.mean_loss(model, micro_batches, args)))
    return records, model


def build_parser():
    parser = cli.core_parser(__doc__.splitlines()[0])
    mixed_precision.add_arguments(parser)
    return parser


def main(argv=None):
    """Returns (records, model) (tests read them)."""
    return run(*cli.setup(build_parser(), argv, mixed_precision.check_precision))


if __name__ == "__main__":
    main()
