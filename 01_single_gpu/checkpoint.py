"""Checkpoints in safetensors, one file per rank, with exact resume.

Layout of `--checkpoint-dir DIR`:
    DIR/step_000100/rank_00000.safetensors   model + optimizer tensors + RNG state of rank 0
    DIR/step_000100/rank_00001.safetensors   ... each rank saves what it holds (its shards)
    DIR/step_000100/meta.json                step, layout and arguments; written last
A checkpoint is written into `step_000100.tmp-*` and renamed into place only when every rank has
finished, so a crash mid-save never damages or hides an earlier checkpoint, and `latest_step`
only ever sees complete ones. The data position is the step itself (the sampler is a pure function
of seed and step), so the model, the optimizer and the step are the whole training state.
"""
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file


def _flatten(obj, prefix, tensors, meta):
    """Split a nested state dict into safetensors-friendly tensors and JSON-friendly metadata."""
    if torch.is_tensor(obj):
        tensors[prefix] = obj.detach().to("cpu", copy=True).contiguous()  # a copy: tied weights may not share storage in safetensors
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {"__dict__": [[_flatten(k, f"{prefix}.k{i}", tensors, meta), _flatten(v, f"{prefix}.{i}", tensors, meta)]
                             for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_flatten(v, f"{prefix}.{i}", tensors, meta) for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    return obj  # numbers, strings, None, bools


def _unflatten(obj, tensors):
    if isinstance(obj, dict) and "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if isinstance(obj, dict) and "__dict__" in obj:
        return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, dict) and "__list__" in obj:
        items = [_unflatten(v, tensors) for v in obj["__list__"]]
        return tuple(items) if obj["tuple"] else items
    return obj


def _world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def save_checkpoint(directory, step: int, model, optimizer, meta: dict):
    """Collective when distributed: every rank writes its file, rank 0 publishes the directory."""
    rank, world = _world()
    final = Path(directory) / f"step_{step:06d}"
    scratch = final.with_name(f"{final.name}.tmp")
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
    if world > 1:
        dist.barrier()
    tensors, structure = {}, {}
    structure["model"] = _flatten(model.state_dict(), "model", tensors, structure)
    structure["optimizer"] = _flatten(optimizer.state_dict(), "optim", tensors, structure)
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    save_file(tensors, scratch / f"rank_{rank:05d}.safetensors", metadata={"structure": json.dumps(structure)})
    if world > 1:
        dist.barrier()
    if rank == 0:
        (scratch / "meta.json").write_text(json.dumps({"step": step, "world_size": world, **meta}, indent=2))
        if final.exists():  # re-saving the same step: keep the old copy until the new one is complete
            shutil.rmtree(final)
        os.rename(scratch, final)
    if world > 1:
        dist.barrier()
    return final


def latest_step(directory):
    """The highest step with a complete checkpoint (meta.json present), or None."""
    steps = [int(p.name[5:]) for p in Path(directory).glob("step_*")
             if p.name[5:].isdigit() and (p / "meta.json").exists()]
    return max(steps, default=None)


# What makes a run the run it is: its model, its data and their order, its global batch and its schedule.
# --resume refuses to change any of them (the rest, e.g. --steps, --dtype, --recompute, logging, may change).
RUN_FLAGS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size",
             "tie_embeddings", "seq_len", "seed", "dataset", "text_column", "tokenizer", "lr", "min_lr_ratio",
             "warmup_steps", "lr_decay_steps", "weight_decay", "grad_clip")


def check_resume(args, directory, global_batch: int):
    """Raise naming the flag if this run differs from the latest checkpoint's in RUN_FLAGS or in the global
    batch; an unset --lr-decay-steps takes the checkpoint's schedule length (so --steps may grow)."""
    step = latest_step(directory)
    if step is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint in {directory}")
    meta = json.loads((Path(directory) / f"step_{step:06d}" / "meta.json").read_text())
    saved = dict(meta["args"])
    saved["lr_decay_steps"] = saved.get("lr_decay_steps") or saved["steps"]
    if args.lr_decay_steps is None:
        args.lr_decay_steps = saved["lr_decay_steps"]
    where = f"(in {directory}/step_{step:06d}): resume with the checkpoint's value, or start a new run in " \
            f"another --checkpoint-dir"
    for name in RUN_FLAGS:
        if name in saved and getattr(args, name) != saved[name]:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"--resume: {flag} {getattr(args, name)} differs from the checkpoint's "
                             f"{saved[name]} {where}")
    saved_batch = meta.get("global_batch", saved["mbs"] * saved["grad_acc"] * meta.get("dp", 1))
    if global_batch != saved_batch:
        raise ValueError(f"--resume: a global batch of {global_batch} sequences differs from the checkpoint's "
                         f"{saved_batch} (dp·mbs·grad_acc) {where}")


def load_checkpoint(directory, model, optimizer, layout: dict) -> int:
    """Restore the latest checkpoint into model/optimizer; returns its step."""
    rank, world = _world()
    step = latest_step(directory)
    if step is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint in {directory}")
    folder = Path(directory) / f"step_{step:06d}"
    meta = json.loads((folder / "meta.json").read_text())
    saved_layout = {k: meta.get(k) for k in layout}
    if meta["world_size"] != world or saved_layout != layout:
        raise ValueError(f"{folder} was saved with world_size={meta['world_size']} {saved_layout}; this run has "
                         f"world_size={world} {layout}: resume with the same layout")
    path = folder / f"rank_{rank:05d}.safetensors"
    tensors = load_file(path)
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        structure = json.loads(f.metadata()["structure"])
    model.load_state_dict(_unflatten(structure["model"], tensors))
    optimizer.load_state_dict(_unflatten(structure["optimizer"], tensors))
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return step
