"""The checks of cli.parse_args: every flag's value, and every file the flags name, before training.

They run on every rank before any process group exists, so a mistake ends the run in one line from
rank 0 naming the fix, not in a hang: `check_values` (numbers out of range, flags that need another one),
`check_inputs` (the outputs can be written; the data source, tokenizer, --init-from directory and the
checkpoint to resume exist and look right, none of them loaded). Each raises a ValueError that cli turns
into the line.
"""
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

import build
import checkpoint
import data
import hf_io
import memory
import model as modeling
import rank0
import resume_checks
import sources


YEAR_S = 365 * 24 * 3600
SMALLER = "train a smaller model (--hidden-size, --num-layers, --vocab-size, --preset)"
SHORTER = "lower --mbs or --seq-len, or pass --recompute full"
# how the preflight's refusal opens (08's sweep records such a row as out of memory, from its estimate)
MEMORY_REFUSAL = "this run needs at least"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_values(args):
    """Values that cannot be right, and flags that need another one: a ValueError naming the flag."""
    optional = [n for n in ("lr_decay_steps", "vocab_size") if getattr(args, n) is not None]
    for name in ["steps", "seq_len", "mbs", "grad_acc", "log_every", "hidden_size", "intermediate_size",
                 "num_layers", "num_heads", "num_kv_heads", *optional]:
        if getattr(args, name) < 1:
            raise ValueError(f"{_flag(name)} must be at least 1, got {getattr(args, name)}")
    for name in ("warmup_steps", "checkpoint_every", "keep_last", "eval_every"):
        if getattr(args, name) < 0:
            raise ValueError(f"{_flag(name)} must be 0 or more, got {getattr(args, name)}")
    check_floats(args)
    if args.profile and args.steps < 3:
        raise ValueError(f"--profile records from the 3rd step on (1 skipped, 1 warm-up): pass --steps 3 or "
                         f"more, got {args.steps}")
    for name in ("checkpoint_every", "keep_last", "resume", "overwrite"):
        if getattr(args, name) and not args.checkpoint_dir:
            raise ValueError(f"{_flag(name)} needs --checkpoint-dir DIR")
    if args.eval_batches < 1:
        raise ValueError(f"--eval-batches must be at least 1, got {args.eval_batches}")
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run saved in --checkpoint-dir, --overwrite starts a new run "
                         "there: pass one of them")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu")
    check_triton(args.kernels, args.attn)
    if args.compile and "triton" in (args.kernels, args.attn) and not torch.cuda.is_available():
        raise ValueError("--compile with Triton kernels on the CPU: torch.compile cannot trace Triton's "
                         "interpreter, which runs them here: drop --compile or run on a GPU")
    compiler = os.environ.get("CXX", "g++")     # the C++ compiler inductor builds its CPU kernels with
    if args.compile and args.device == "cpu" and not shutil.which(compiler):
        raise ValueError(f"--compile on the CPU builds C++ kernels, but the compiler {compiler} is not on "
                         f"PATH: install g++ (or set CXX), or drop --compile")
    if args.compile and getattr(args, "num_experts", 0):    # 07's and 08's MoE layers
        raise ValueError("--compile does not take the mixture-of-experts layer: its routing sizes depend on "
                         "the data (graph breaks, a recompile per batch, ranks stalled in collectives): drop "
                         "--compile")


def check_floats(args):
    """The rates, the clip and the timeout: finite, and in their range."""
    for name in ["lr", "timeout_s"] + (["peak_tflops"] if args.peak_tflops is not None else []):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            raise ValueError(f"{_flag(name)} must be a positive finite number, got {getattr(args, name)}")
    if args.timeout_s > YEAR_S:        # the process group's timeout is a C++ duration: 1e300 s overflows it
        raise ValueError(f"--timeout-s must be at most {YEAR_S} (a year), got {args.timeout_s:g}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise ValueError(f"--weight-decay must be 0 or more (a finite number), got {args.weight_decay}")
    if not (math.isfinite(args.grad_clip) and args.grad_clip >= 0):
        raise ValueError(f"--grad-clip must be 0 (off) or positive (a finite number), got {args.grad_clip}")
    if not 0 <= args.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio must be between 0 and 1, got {args.min_lr_ratio}")


def check_heads(hidden: int, heads: int, kv_heads: int):
    """The heads split the width into even head dims, the kv heads the heads into whole groups (model.py's
    rules for a config.json, here in the flags' words)."""
    if hidden % heads:
        raise ValueError(f"--num-heads {heads} does not divide --hidden-size {hidden}: pass a --hidden-size "
                         f"that is a multiple of {heads} (e.g. {max(hidden // heads, 1) * heads}), or other "
                         f"--num-heads")
    if heads % kv_heads:
        raise ValueError(f"--num-kv-heads {kv_heads} does not divide --num-heads {heads}: pass a divisor of "
                         f"{heads}, such as {math.gcd(heads, kv_heads)} (grouped-query attention needs whole "
                         f"groups)")
    if hidden // heads % 2:
        raise ValueError(f"--hidden-size {hidden} / --num-heads {heads} gives head_dim {hidden // heads}, "
                         f"and head_dim {hidden // heads} must be even for rotary embeddings: pass another "
                         f"--hidden-size or --num-heads")


def check_memory(args, config):
    """The preflight: what this rank needs at least (memory.rank_lower_bound) against what it may allocate
    (build.free_bytes), before anything is; a ValueError naming the flags that shrink what cannot fit."""
    need = memory.rank_lower_bound(config, args, build.activation_element_bytes(args))
    free, where = build.free_bytes(args)
    if sum(need.values()) <= free:
        return
    shards = [flag for flag, name in (("--zero-stage 3", "zero_stage"), ("--tp", "tp"), ("--pp", "pp"))
              if hasattr(args, name)]
    smaller = SMALLER + (f" or shard it over more ranks ({', '.join(shards)})" if shards else
                         " or shard it (03_zero/train.py --zero-stage 3, 04_tensor_parallel/train.py --tp)")
    total = sum(need.values())
    # the flags of each part (the states, the activations) that alone cannot fit, or of the larger
    parts = sorted(((total - need["activations"], smaller), (need["activations"], SHORTER)), reverse=True)
    fixes = [fix for part, fix in parts if part > free] or [parts[0][1]]
    shown = ", ".join(f"{what} {size / 2**30:,.1f}" for what, size in need.items())
    raise ValueError(f"{MEMORY_REFUSAL} {total / 2**30:,.1f} GiB on each rank ({shown} GiB), but "
                     f"{where} {free / 2**30:,.1f} GiB: {'; '.join(fixes)}; or pass --no-memory-check")


def check_triton(kernels: str, attn: str):
    """Triton kernels run on a CUDA GPU, or on the CPU in Triton's interpreter (TRITON_INTERPRET=1)."""
    flags = " and ".join(f"--{name} triton" for name, value in (("kernels", kernels), ("attn", attn))
                         if value == "triton")
    if not flags or torch.cuda.is_available():
        return
    try:
        import triton
    except ImportError:
        raise ValueError(f"{flags} needs the triton package: pip install triton") from None
    if not triton.knobs.runtime.interpret:
        raise ValueError(f"{flags} needs a CUDA GPU and none is visible: on a CPU, start with "
                         f"TRITON_INTERPRET=1 (Triton's interpreter, slow: for tests), or pass --kernels "
                         f"torch --attn sdpa")


def check_inputs(args) -> dict:
    """The files the flags name, without loading them: the outputs can be written, the data source, the
    tokenizer and --init-from exist and look right, and --checkpoint-dir holds what --resume says (with
    `--resume auto`, a folder without any step_* folder means a new run). Returns what the checkpoint
    decides: the flags' values that --resume sets (`checkpoint_choice`)."""
    check_output_file(args.json_log, "--json-log")
    if args.profile:
        check_output_folder(args.profile, "--profile")
    # --timeline: 06's and 08's flag
    check_output_file(getattr(args, "timeline", None), "--timeline", (".png", ".svg", ".pdf"))
    if args.plot:
        check_output_folder(args.plot, "--plot")
    if args.tensorboard:
        check_output_folder(args.tensorboard, "--tensorboard")
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard writes its event files)
        except ImportError:
            raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    if args.dataset == data.SYNTHETIC:    # random ids of the model's vocabulary: no text, no tokenizer
        for flag, value, default in (("--tokenizer", args.tokenizer, "bytes"),
                                     ("--text-column", args.text_column, "text")):
            if value != default:
                raise ValueError(f"--dataset synthetic draws token ids, no text is read: drop {flag} (the "
                                 f"model's vocabulary is --vocab-size or the preset's)")
    else:
        sources.check_source(args.dataset, args.text_column, args.seq_len + 1)
    sources.check_tokenizer(args.tokenizer)
    if args.init_from:
        hf_io.check_hf_dir(args.init_from, modeling.LlamaConfig, modeling.LlamaForCausalLM)
    if not args.checkpoint_dir:
        return {}
    check_output_folder(args.checkpoint_dir, "--checkpoint-dir")
    return checkpoint_choice(args)


def checkpoint_choice(args) -> dict:
    """--resume: the step, run id and schedule length of the checkpoint to continue; --resume auto in a
    folder without checkpoints: a new run (resume None); no --resume: a folder it may write into."""
    if args.resume == "auto" and not checkpoint.checkpoint_steps(args.checkpoint_dir):
        rank0.print0(f"--resume auto: no checkpoint in {args.checkpoint_dir} yet: a new run, from step 1")
        resume_checks.check_new_run(args.checkpoint_dir, args.overwrite)
        return {"resume": None}
    if not args.resume:
        resume_checks.check_new_run(args.checkpoint_dir, args.overwrite)
        return {}
    world_size, global_batch = int(os.environ.get("WORLD_SIZE", 1)), global_batch_of(args)
    resumed = resume_checks.check_resume(args, args.checkpoint_dir, global_batch, world_size)
    for step, problem in resumed.skipped:
        rank0.print0(f"warning: {args.checkpoint_dir}/step_{step:06d} is unusable ({problem}); "
                     f"resuming from step {resumed.step}", file=sys.stderr)
    return {"resume_step": resumed.step, "run_id": resumed.run_id, "lr_decay_steps": resumed.lr_decay_steps}


def global_batch_of(args) -> int:
    """dp·mbs·grad_acc sequences (a trainer without --dp is a world of one replica)."""
    return getattr(args, "dp", 1) * args.mbs * args.grad_acc


def check_output_file(path, flag: str, suffixes=()):
    """A file the run will write: its folder exists and is writable, and it is not itself a folder."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder: pass a file path such as {path / 'run.jsonl'}")
    if suffixes and path.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {path}: the format comes from the suffix: use {', '.join(suffixes[:-1])} "
                         f"or {suffixes[-1]}")
    check_output_folder(path.parent, flag, of=path)


def check_output_folder(folder, flag: str, of=None):
    """A folder the run writes into (created if missing): its nearest existing ancestor is writable."""
    folder, what = Path(folder), f"{flag} {of or folder}"
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{what}: {folder} is a file, not a folder" if of else
                         f"{flag} {folder} is a file: pass a folder (it is created if missing)")
    existing = next(p for p in [folder, *folder.absolute().parents] if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{what}: {existing} is a file, not a folder")
    if of is not None and existing != folder:
        raise ValueError(f"{what}: the folder {folder} does not exist: create it or pass another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: no permission to write in {existing}: pass another path")
    try:    # os.access says yes to root everywhere, also on /proc or a read-only mount: try for real
        tempfile.TemporaryDirectory(dir=existing, prefix=".write-check-").cleanup()
    except OSError as error:
        raise ValueError(f"{what}: cannot create a folder in {existing} ({error.strerror}): "
                         f"pass another path") from None
