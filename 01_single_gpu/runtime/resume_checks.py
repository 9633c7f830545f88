"""Is this run the run that saved --checkpoint-dir's checkpoints? Checked before any process group exists.

`--resume` continues a run only as itself: the same flags but FREE_FLAGS (the parallel layout among them:
a checkpoint holds global pieces, any layout of the same global batch resumes it), the same global batch,
the same experts (`check_resume`). A run without --resume refuses a folder holding another run's
checkpoints unless `--overwrite` (`check_new_run`). checkpoint.py writes and reads the checkpoints.

    python 01_single_gpu/train.py --steps 200 --checkpoint-dir ckpt --resume auto

Plumbing written once and reused by every folder's trainer (cli_checks.py calls it).
"""
import json
from dataclasses import replace
from pathlib import Path

import checkpoint
import data
import flags


# What makes a run the run it is may not change under --resume: every flag but these, which are free (the
# parallel layout among them: a checkpoint holds global pieces, any layout of the same global batch resumes
# it). A flag only one trainer has is not compared: the model's config and parameter names are.
# --eval-batches is not free: its windows leave training.
FREE_FLAGS = {"steps", "mbs", "grad_acc", "dtype", "device", "recompute", "kernels", "attn", "json_log",
              "log_every", "no_progress", "peak_tflops", "checkpoint_dir", "checkpoint_every", "keep_last",
              "resume", "overwrite", "timeout_s", "on_nonfinite", "timeline", "dp_mode", "bucket_mb",
              "pp_schedule", "cp_layout", "cp_attn", "init_from", "preset", "run_id", "resume_step",
              "dp", "tp", "pp", "cp", "ep", "pp_chunks", "sp", "zero_stage", "precision_layout",
              "loss_scale_init", "loss_scale_window", "profile", "offload", "partition_activations",
              "eval_every", "plot", "tensorboard", "compile", "no_memory_check"}


def check_resume(args, directory, global_batch: int, world_size: int) -> checkpoint.Resume:
    """The checkpoint --resume continues from, after checking that this run is the run that saved it: the
    same flags but FREE_FLAGS (the layout may change) and the same global batch. An unset --lr-decay-steps
    takes the checkpoint's schedule length (so --steps may grow): the returned `lr_decay_steps`. Raises a
    ValueError naming the flag."""
    resume = checkpoint.newest_usable(directory)
    where = f"{directory}/step_{resume.step:06d}"
    manifest = json.loads((Path(where) / checkpoint.MANIFEST).read_text())
    if manifest.get("format") != checkpoint.FORMAT:
        raise ValueError(f"--resume: {where} was written by an older checkpoint.py: start a new run "
                         f"(--overwrite)")
    saved = dict(manifest["args"])
    saved["lr_decay_steps"] = saved.get("lr_decay_steps") or saved["steps"]
    mine = {**vars(args), "lr_decay_steps": args.lr_decay_steps or saved["lr_decay_steps"]}
    saved["vocab_size"] = manifest["config"]["vocab_size"]          # the vocabulary the model has
    if args.vocab_size is None:            # unset: the tokenizer's vocabulary (--init-from: its config's)
        if manifest["args"].get("vocab_size") is not None and not args.init_from:
            check_default_vocab(args.tokenizer, saved["vocab_size"], where)
        mine["vocab_size"] = saved["vocab_size"]
    for name in sorted(mine.keys() & saved.keys() - FREE_FLAGS):
        if mine[name] != saved[name]:
            raise ValueError(f"--resume: --{name.replace('_', '-')} {mine[name]} differs from the "
                             f"checkpoint's {saved[name]} (in {where}): resume with the checkpoint's value, "
                             f"or start a new run in another --checkpoint-dir")
    saved_experts = len({piece["name"].split(".mlp.experts.")[1].split(".")[0] for piece in manifest["pieces"]
                         if ".mlp.experts." in piece["name"]})
    if saved_experts != getattr(args, "num_experts", 0):
        kind = (f"a mixture-of-experts run ({saved_experts} experts per layer)" if saved_experts
                else "a dense run")
        raise ValueError(f"--resume: {where} was saved by {kind}, this run has "
                         f"{getattr(args, 'num_experts', 0)}: resume with the trainer and --num-experts that "
                         f"saved it")
    if global_batch != manifest["global_batch"]:
        raise ValueError(f"--resume: a global batch of {global_batch} sequences differs from the "
                         f"checkpoint's {manifest['global_batch']} (dp·mbs·grad_acc) (in {where}): resume "
                         f"with the checkpoint's, or start a new run in another --checkpoint-dir")
    return replace(resume, lr_decay_steps=mine["lr_decay_steps"])


def check_default_vocab(tokenizer: str, saved: int, where: str):
    """An unset --vocab-size makes the model's vocabulary the tokenizer's (flags.default_vocab_size): the
    checkpoint's, or a ValueError naming the --vocab-size to pass (--tokenizer is compared as a flag)."""
    tokens = data.load_tokenizer(tokenizer).vocab_size
    if flags.default_vocab_size(tokens) != saved:
        raise ValueError(f"--resume: the model's vocabulary would be {flags.default_vocab_size(tokens)} "
                         f"(--vocab-size unset: the tokenizer's {tokens} ids rounded up to a multiple of "
                         f"64), the checkpoint's is {saved} (in {where}): pass --vocab-size {saved}")


def check_new_run(directory, overwrite: bool):
    """A run without --resume writes into a folder without checkpoints, or replaces them (--overwrite):
    otherwise a later --resume would silently continue the other run."""
    steps = checkpoint.checkpoint_steps(directory)
    if steps and not overwrite:
        shown = ", ".join(map(str, steps[:3])) + (", ..." if len(steps) > 3 else "")
        raise ValueError(f"--checkpoint-dir {directory} holds another run's checkpoints (steps {shown}): "
                         f"pass --resume to continue it, --overwrite to replace it, or another "
                         f"--checkpoint-dir")
