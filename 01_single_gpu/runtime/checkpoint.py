"""Checkpoints that move between layouts: safetensors pieces in global coordinates, a manifest of checksums.

Layout of `--checkpoint-dir DIR`:
    DIR/step_000100/rank_00000.safetensors   the pieces of state rank 0 is the first to hold: parameter
    DIR/step_000100/rank_00001.safetensors   values and AdamW's moments, by global name, block and range
    DIR/step_000100/manifest.json            step, layout, arguments, model config, run id, fp16's loss
                                             scale, every piece's place, each file's size and sha256, and
                                             its own sha256; rank 0 writes it last
Pieces (global_state.py) make a checkpoint independent of the layout that saved it: `--resume` continues in
any other layout of the same global batch (and `export_hf.py` writes it as a Hugging Face Llama). A checkpoint
is written into `step_000100.tmp` and renamed into place when every rank has finished (an older copy of the
step is removed only after that), so a crash never damages or hides an earlier checkpoint. `--resume` takes
the newest checkpoint whose files match their manifest and says which newer ones it skipped; it refuses to
continue as another run (other model, data, batch or schedule: resume_checks.py). A new run refuses a folder
holding another run's checkpoints unless `--overwrite`; `--keep-last N` keeps the newest N. The data position
is the step itself (the sampler is a pure function of seed and step).
"""
import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import global_state

MANIFEST = "manifest.json"
FORMAT = 2                      # pieces in global coordinates (global_state.py): any layout resumes any other


def _world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def sha256_of(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


class SaveFailed(Exception):
    """A checkpoint that could not be written (a full disk: no space, no inode), raised on every rank once its
    torn folder is gone. The checkpoints saved before it are untouched: nothing was published or pruned."""


def save_checkpoint(directory, step: int, model, optimizer, meta: dict, keep_last: int = 0,
                    replace_other_runs: bool = False):
    """Collective when distributed: every rank writes the pieces of its state it is the first to hold
    (global_state.py: global names, blocks, ranges; values and AdamW's moments), rank 0 the manifest.

    `meta` holds "layout", "global_batch" and "args" (whose "run_id" names the run). Rank 0 then removes
    the checkpoints of other runs (`replace_other_runs`: --overwrite) and all but the newest `keep_last`.
    A write that fails on any rank raises SaveFailed on every rank (none waits in a collective).
    """
    rank, world = _world()
    final = Path(directory) / f"step_{step:06d}"
    scratch = final.with_name(f"{final.name}.tmp")
    problems = attempt(fresh_folder, scratch) if rank == 0 else []
    files, listed, problems = _write_pieces(scratch, optimizer, rank, world, problems)
    if rank == 0 and not problems:
        manifest = _manifest(step, world, model, optimizer, meta, files, listed)
        problems = attempt((scratch / MANIFEST).write_text, json.dumps(manifest, indent=2))
    if world > 1:                                       # rank 0's manifest: the last write that can fail
        shared = [problems]
        dist.broadcast_object_list(shared, src=0)
        problems = shared[0]
    if problems:
        if rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        raise SaveFailed(problems[0])
    if rank == 0:
        publish(scratch, final)
        _prune(Path(directory), step, meta["args"]["run_id"], keep_last, replace_other_runs)
    if world > 1:
        dist.barrier()
    return final


def attempt(write, *args) -> list:
    """[] once `write(*args)` has written, else [what the system said]: OSError's words (no space, no inode
    left), or safetensors' own error for its file (SafetensorError, not an OSError)."""
    try:
        write(*args)
        return []
    except (OSError, SafetensorError) as error:
        return [getattr(error, "strerror", None) or str(error)]


def fresh_folder(scratch: Path):
    """An empty `scratch` folder to write into: a crashed write's torn one is removed first."""
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)


def _write_pieces(scratch: Path, optimizer, rank: int, world: int, problems: list):
    """Every rank's file of the pieces it is the first to hold: ([(file, its size and sha256)], [every
    rank's pieces], [every rank's problem]), the same on every rank. A rank with a problem writes nothing."""
    mine = global_state.pieces(optimizer)
    everyone = [[segment.key for segment, _ in mine]]
    if world > 1:
        everyone = [None] * world
        dist.barrier()
        dist.all_gather_object(everyone, [segment.key for segment, _ in mine])
    writer = {}
    # each distinct piece: written by the first rank holding it
    for r, rank_keys in enumerate(everyone):
        for key in rank_keys:
            writer.setdefault(key, r)
    path, tensors, listed = scratch / f"rank_{rank:05d}.safetensors", {}, []
    for index, (segment, data) in enumerate(mine):
        if writer[segment.key] == rank and segment.key not in {tuple(e["key"]) for e in listed}:
            for quantity, flat in data.items():
                tensors[f"{quantity}/{index}"] = flat.detach().to("cpu", copy=True).contiguous()
            listed.append({**asdict(segment), "key": list(segment.key), "file": path.name, "index": index})
    problems = problems or attempt(save_file, tensors, path)
    file = None if problems else (path.name, {"bytes": path.stat().st_size, "sha256": sha256_of(path)})
    gathered = [(file, listed, problems)]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (file, listed, problems))
    return ([f for f, _, _ in gathered], [piece for _, pieces, _ in gathered for piece in pieces],
            [problem for _, _, rank_problems in gathered for problem in rank_problems])


def _manifest(step, world, model, optimizer, meta, files, listed) -> dict:
    """What rank 0 writes last: the run, its model and optimizer step, every file's size and sha256, every
    piece's place, and its own sha256."""
    scaler = getattr(optimizer, "scaler", None)          # fp16's loss scale (mixed_precision.py)
    manifest = {"format": FORMAT, "step": step, "world_size": world, "run_id": meta["args"]["run_id"],
                **meta, "config": global_state.model_config(model),
                "optimizer_step": global_state.optimizer_step(optimizer),
                "loss_scaler": scaler.state_dict() if scaler else None, "files": dict(files),
                "pieces": listed}
    manifest = json.loads(json.dumps(manifest))         # as it will read back (tuples as lists)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    return manifest


def publish(scratch: Path, final: Path):
    """Rename the complete scratch folder into place. An older copy (of the step; export_hf.py's --out) is
    moved aside first and removed only once the new one is in place: a crash in between leaves it on disk
    (as step_N.old)."""
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


def manifest_digest(manifest: dict) -> str:
    """The sha256 of the manifest without its own checksum: a changed value in it is blamed on it, not on
    the data file whose recorded size or sha256 it changed."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def verify(folder: Path):
    """(problem or None, manifest or None): every file of the manifest there, with its size and sha256."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST}: its save did not finish, or an older version of checkpoint.py wrote it", None
    except json.JSONDecodeError as error:
        return f"{MANIFEST} is not valid JSON ({error})", None
    if "manifest_sha256" in manifest and manifest_digest(manifest) != manifest["manifest_sha256"]:
        return (f"{MANIFEST} fails its own sha256 check: a value in it was changed after the save (the data "
                f"files were not checked)"), None
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
    lr_decay_steps: int | None = None   # the schedule's length the resumed run keeps (check_resume)


def newest_usable(directory, reader: bool = False) -> Resume:
    """The newest checkpoint whose files match their manifest; a ValueError naming the fix if none does,
    in the trainer's flags (--resume), or (`reader`) in those of generate.py and export_hf.py."""
    fix = "pass a trainer's --checkpoint-dir"
    if not Path(directory).is_dir():
        raise ValueError(f"--checkpoint-dir {directory} does not exist: {fix}" if reader else
                         f"--resume: {directory} does not exist: pass the --checkpoint-dir of the run to "
                         f"continue")
    skipped = []
    for step in checkpoint_steps(directory):
        problem, manifest = verify(Path(directory) / f"step_{step:06d}")
        if problem is None:
            return Resume(step, manifest.get("run_id"), skipped)
        skipped.append((step, problem))
    if not skipped:
        raise ValueError(f"--checkpoint-dir {directory} holds no checkpoint (no step_* folder): {fix}"
                         if reader else
                         f"--resume: no checkpoint in {directory} (no step_* folder): start without "
                         f"--resume, or pass --resume auto (a new run where none was saved yet)")
    problems = "; ".join(f"step_{step:06d}: {problem}" for step, problem in skipped)
    raise ValueError(f"--checkpoint-dir {directory} holds no usable checkpoint: {problems}: pass the "
                     f"--checkpoint-dir of a run whose save finished" if reader else
                     f"--resume: no usable checkpoint in {directory}: {problems}: start a new run "
                     f"(--overwrite)")


def piece_reader(folder: Path):
    """read(piece, quantity): one piece of a saved quantity from the checkpoint's files, each opened once."""
    handles = {}

    def read(piece, quantity):
        if piece["file"] not in handles:
            handles[piece["file"]] = safe_open(folder / piece["file"], "pt")
        return handles[piece["file"]].get_tensor(f"{quantity}/{piece['index']}")
    return read


def load_checkpoint(directory, model, optimizer, layout: dict, step: int | None = None) -> int:
    """Restore checkpoint `step` (default: the newest usable), saved in any layout, into this rank's model and
    optimizer (global_state.load: one global tensor at a time); returns its step. `layout` is this run's."""
    step = newest_usable(directory).step if step is None else step
    folder = Path(directory) / f"step_{step:06d}"
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{folder} was written by an older checkpoint.py (one file of state dicts per "
                         f"rank): start a new run")
    saved, mine = manifest["config"], global_state.model_config(model)
    different = sorted(k for k in saved.keys() | mine.keys() if saved.get(k) != mine.get(k))
    if different:
        shown = ", ".join(f"{k} {saved.get(k)} vs {mine.get(k)}" for k in different[:3])
        raise ValueError(f"{folder} holds another model ({shown}): resume with the model flags that saved it")
    assembler = global_state.Assembler(manifest["pieces"], piece_reader(folder))
    global_state.load(assembler, optimizer, model, manifest["optimizer_step"])
    scaler = getattr(optimizer, "scaler", None)
    # fp16's loss scale continues; saved without fp16 (or by an older version): --loss-scale-init
    if scaler and manifest.get("loss_scaler"):
        scaler.load_state_dict(manifest["loss_scaler"])
    return step
