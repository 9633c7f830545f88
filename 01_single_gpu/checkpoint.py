"""Checkpoints in safetensors, one file per rank, with a manifest of checksums and exact resume.

Layout of `--checkpoint-dir DIR`:
    DIR/step_000100/rank_00000.safetensors   model + optimizer tensors + RNG state of rank 0
    DIR/step_000100/rank_00001.safetensors   ... each rank saves what it holds (its shards)
    DIR/step_000100/manifest.json            step, layout, arguments, run id, and each file's size and
                                             sha256; rank 0 writes it last
A checkpoint is written into `step_000100.tmp` and renamed into place only when every rank has finished
(an older copy of the same step is removed only after that), so a crash mid-save never damages or hides
an earlier checkpoint. `--resume` takes the newest checkpoint whose files all match their manifest and
says which newer ones it skipped (torn, truncated, flipped bits); it refuses to continue as another run
(other model, data, batch, schedule or layout: `check_resume`). A new run refuses a folder holding another
run's checkpoints unless `--overwrite` (they are removed once the new run has published its first);
`--keep-last N` keeps the newest N of the run. The data position is the step itself (the sampler is a
pure function of seed and step), so the model, the optimizer and the step are the whole training state.
"""
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
# What makes a run the run it is may not change under --resume: every flag but these (free to change) and
# the parallel layout (compared with these neutral values for a trainer that lacks the flag; a checkpoint
# holds per-rank shards, so it resumes only into the layout that saved it).
FREE_FLAGS = {"steps", "mbs", "grad_acc", "dtype", "device", "recompute", "kernels", "attn", "json_log",
              "log_every", "no_progress", "peak_tflops", "checkpoint_dir", "checkpoint_every", "keep_last",
              "resume", "overwrite", "timeout_s", "on_nonfinite", "timeline", "dp_mode", "bucket_mb",
              "pp_schedule", "cp_layout", "cp_attn", "init_from", "preset", "run_id", "resume_step"}
LAYOUT_FLAGS = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "pp_chunks": 1, "sp": False, "zero_stage": 0}


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


def sha256_of(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(directory, step: int, model, optimizer, meta: dict, keep_last: int = 0,
                    replace_other_runs: bool = False):
    """Collective when distributed: every rank writes its file and its checksum, rank 0 the manifest.

    `meta` holds "layout", "global_batch" and "args" (whose "run_id" names the run). Rank 0 then removes
    the checkpoints of other runs (`replace_other_runs`: --overwrite) and all but the newest `keep_last`.
    """
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
    path = scratch / f"rank_{rank:05d}.safetensors"
    save_file(tensors, path, metadata={"structure": json.dumps(structure)})
    files = [(path.name, {"bytes": path.stat().st_size, "sha256": sha256_of(path)})]   # read back: what is on disk
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, files[0])
        files = everyone
    if rank == 0:
        manifest = {"step": step, "world_size": world, "run_id": meta["args"]["run_id"], **meta, "files": dict(files)}
        (scratch / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _publish(scratch, final)
        _prune(Path(directory), step, meta["args"]["run_id"], keep_last, replace_other_runs)
    if world > 1:
        dist.barrier()
    return final


def _publish(scratch: Path, final: Path):
    """Rename the complete scratch folder into place. An older copy of the step is moved aside first and
    removed only once the new one is in place: a crash in between leaves it on disk (as step_N.old)."""
    old = final.with_name(f"{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(scratch, final)
    shutil.rmtree(old, ignore_errors=True)


def checkpoint_steps(directory) -> list:
    """The steps of the step_NNNNNN folders in `directory`, newest first (complete or not)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((int(p.name[5:]) for p in directory.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                  reverse=True)


def _prune(directory: Path, saved: int, run_id: str, keep_last: int, replace_other_runs: bool):
    """Remove other runs' checkpoints (if asked) and this run's older than its newest `keep_last` up to
    `saved` (newer ones of this run, left unusable by a fallback, stay for the record)."""
    mine = []
    for step in checkpoint_steps(directory):
        folder = directory / f"step_{step:06d}"
        try:
            owner = json.loads((folder / MANIFEST).read_text()).get("run_id")
        except (OSError, json.JSONDecodeError):
            owner = None
        if owner != run_id:
            if replace_other_runs:
                shutil.rmtree(folder)
        elif step <= saved:
            mine.append(step)
    for step in mine[keep_last:] if keep_last else []:
        shutil.rmtree(directory / f"step_{step:06d}")


def verify(folder: Path):
    """(problem or None, manifest or None): every file of the manifest there, with its size and sha256."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST}: its save did not finish, or an older version of checkpoint.py wrote it", None
    except json.JSONDecodeError as error:
        return f"{MANIFEST} is not valid JSON ({error})", None
    for name, entry in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing", manifest
        if path.stat().st_size != entry["bytes"]:
            size = path.stat().st_size
            return f"{name} has {size} bytes, the manifest says {entry['bytes']}: a torn copy", manifest
        if sha256_of(path) != entry["sha256"]:
            return f"{name} fails its sha256 check: the file is corrupt", manifest
    return None, manifest


@dataclass
class Resume:
    step: int           # the checkpoint to continue from
    run_id: str         # the run that saved it (this run keeps the id)
    skipped: list       # (step, problem) of the newer checkpoints that are unusable


def newest_usable(directory) -> Resume:
    """The newest checkpoint whose files match their manifest; a ValueError naming the fix if none does."""
    if not Path(directory).is_dir():
        raise ValueError(f"--resume: {directory} does not exist: pass the --checkpoint-dir of the run to continue")
    skipped = []
    for step in checkpoint_steps(directory):
        problem, manifest = verify(Path(directory) / f"step_{step:06d}")
        if problem is None:
            return Resume(step, manifest.get("run_id"), skipped)
        skipped.append((step, problem))
    if not skipped:
        raise ValueError(f"--resume: no checkpoint in {directory} (no step_* folder): start without --resume")
    raise ValueError(f"--resume: no usable checkpoint in {directory}: "
                     + "; ".join(f"step_{step:06d}: {problem}" for step, problem in skipped)
                     + ": start a new run (--overwrite)")


def check_resume(args, directory, global_batch: int, world_size: int) -> Resume:
    """The checkpoint --resume continues from, after checking that this run is the run that saved it: the
    same flags but FREE_FLAGS, the same layout, world size and global batch. An unset --lr-decay-steps takes
    the checkpoint's schedule length (so --steps may grow). Raises a ValueError naming the flag."""
    resume = newest_usable(directory)
    where = f"{directory}/step_{resume.step:06d}"
    manifest = json.loads((Path(where) / MANIFEST).read_text())
    saved, mine = dict(manifest["args"]), vars(args)
    saved["lr_decay_steps"] = saved.get("lr_decay_steps") or saved["steps"]
    if args.lr_decay_steps is None:
        args.lr_decay_steps = saved["lr_decay_steps"]
    for name in [*mine, *(n for n in saved if n not in mine)]:
        flag = "--" + name.replace("_", "-")
        if name in FREE_FLAGS:
            continue
        if name in LAYOUT_FLAGS:
            old, new = saved.get(name, LAYOUT_FLAGS[name]), mine.get(name, LAYOUT_FLAGS[name])
            if old != new:
                raise ValueError(f"--resume: {where} was saved with {flag} {old}, this run has {new}: resume "
                                 f"with the same layout (a checkpoint holds each rank's shards)")
        elif name not in mine:
            raise ValueError(f"--resume: {where} was saved with {flag} {saved[name]}, a flag this trainer does "
                             f"not have: resume it with the trainer that saved it")
        elif name not in saved:
            raise ValueError(f"--resume: the trainer that saved {where} has no {flag}: resume it with that "
                             f"trainer, or start a new run in another --checkpoint-dir")
        elif mine[name] != saved[name]:
            raise ValueError(f"--resume: {flag} {mine[name]} differs from the checkpoint's {saved[name]} (in "
                             f"{where}): resume with the checkpoint's value, or start a new run in another "
                             f"--checkpoint-dir")
    if manifest["world_size"] != world_size:
        raise ValueError(f"--resume: {where} was saved by {manifest['world_size']} ranks, this run has "
                         f"{world_size}: resume with the same layout")
    if global_batch != manifest["global_batch"]:
        raise ValueError(f"--resume: a global batch of {global_batch} sequences differs from the checkpoint's "
                         f"{manifest['global_batch']} (dp·mbs·grad_acc) (in {where}): resume with the "
                         f"checkpoint's, or start a new run in another --checkpoint-dir")
    return resume


def check_new_run(directory, overwrite: bool):
    """A run without --resume writes into a folder without checkpoints, or replaces them (--overwrite):
    otherwise a later --resume would silently continue the other run."""
    steps = checkpoint_steps(directory)
    if steps and not overwrite:
        shown = ", ".join(map(str, steps[:3])) + (", ..." if len(steps) > 3 else "")
        raise ValueError(f"--checkpoint-dir {directory} holds another run's checkpoints (steps {shown}): pass "
                         f"--resume to continue it, --overwrite to replace it, or another --checkpoint-dir")


def load_checkpoint(directory, model, optimizer, layout: dict, step: int | None = None) -> int:
    """Restore checkpoint `step` (default: the newest usable) into model/optimizer; returns its step."""
    rank, world = _world()
    step = newest_usable(directory).step if step is None else step
    folder = Path(directory) / f"step_{step:06d}"
    manifest = json.loads((folder / MANIFEST).read_text())
    keys = sorted(manifest["layout"].keys() | layout.keys())
    saved_layout = {k: manifest["layout"].get(k, LAYOUT_FLAGS.get(k)) for k in keys}
    this_layout = {k: layout.get(k, LAYOUT_FLAGS.get(k)) for k in keys}
    if manifest["world_size"] != world or saved_layout != this_layout:
        raise ValueError(f"{folder} was saved with world_size={manifest['world_size']} {saved_layout}; this run has "
                         f"world_size={world} {this_layout}: resume with the same layout")
    path = folder / f"rank_{rank:05d}.safetensors"
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        structure = json.loads(f.metadata()["structure"])
    state = _unflatten(structure["model"], tensors)
    own = model.state_dict()
    different = sorted(k for k in own.keys() | state.keys() if k not in own or k not in state
                       or own[k].shape != state[k].shape)
    if different:
        raise ValueError(f"{path} holds another model's tensors ({different[:3]} differ): resume with the trainer "
                         f"and flags that saved it")
    model.load_state_dict(state)
    optimizer.load_state_dict(_unflatten(structure["optimizer"], tensors))
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return step
