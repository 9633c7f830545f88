"""Export a checkpoint of any parallel layout as a Hugging Face Llama directory.

    python 01_single_gpu/runtime/export_hf.py --checkpoint-dir ckpt --out hf_model [--step N] [--overwrite]

A checkpoint holds every parameter as pieces in global coordinates (global_state.py: name, TP block,
ZeRO flat range), whatever layout saved it: dp × tp × pp × cp, ZeRO-1/2/3. This rebuilds each parameter
from its pieces, one at a time, and writes `config.json` + `model.safetensors` (hf_io.save_hf_state; a model
over --max-shard-mb: shards and their index), which `transformers.LlamaForCausalLM.from_pretrained` loads
with the project's logits; `--overwrite` replaces the whole model at once. A mixture-of-experts checkpoint
(07, 08 --num-experts) is not a Llama: it is refused.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime")]
import json
import math
import shutil
from pathlib import Path

import checkpoint
import cli
import cli_checks
import global_state
import hf_io
import model as modeling
import rank0


def read_checkpoint(checkpoint_dir, step=None):
    """(step, LlamaConfig, {01's parameter name: full tensor}, manifest) of checkpoint `step` (default: the
    newest usable) of `checkpoint_dir`, whatever layout saved it; generate.py samples from it."""
    if step is None or not Path(checkpoint_dir).is_dir():
        newest = checkpoint.newest_usable(checkpoint_dir, reader=True).step     # raises for a missing folder
        step = newest if step is None else step
    folder = Path(checkpoint_dir) / f"step_{step:06d}"
    held = checkpoint.checkpoint_steps(checkpoint_dir)
    if step not in held:
        raise ValueError(f"--step {step}: {checkpoint_dir} holds no checkpoint of step {step}"
                         + (f" (it holds {', '.join(map(str, held[:5]))}): pass one of those" if held else
                            ": pass a trainer's --checkpoint-dir"))
    problem, manifest = checkpoint.verify(folder)
    if problem:
        raise ValueError(f"--step {step}: {folder}: {problem}: pass another --step, or leave it out "
                         f"(the newest usable checkpoint)")
    if manifest.get("format") != checkpoint.FORMAT:
        raise ValueError(f"{folder} was written by an older checkpoint.py: it cannot be read")
    if any(".mlp.experts." in piece["name"] for piece in manifest["pieces"]):
        raise ValueError(f"{folder} holds a mixture-of-experts model: a Hugging Face Llama has no experts")
    config = modeling.LlamaConfig(**manifest["config"])
    read = checkpoint.piece_reader(folder)
    assembler = global_state.Assembler(manifest["pieces"], read)
    state = {}
    for name in sorted(assembler.names()):               # one full tensor at a time, in its saved dtype
        first = next(p for p in manifest["pieces"] if p["name"] == name)
        state[name] = assembler.full(name, "value", read(first, "value").dtype)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return step, config, state, manifest


def check_out(out, overwrite: bool):
    """--out is a folder (created if missing) that holds no model, or --overwrite replaces it."""
    cli_checks.check_output_folder(out, "--out")
    held = [name for name in ("config.json", "model.safetensors", "model.safetensors.index.json")
            if (Path(out) / name).exists()]
    if held and not overwrite:
        raise ValueError(f"--out {out} already holds a model ({', '.join(held)}): pass --overwrite to "
                         f"replace it, or another --out")


def export(checkpoint_dir, out, step=None, overwrite: bool = False, max_shard_bytes=None):
    """Write checkpoint `step` (default: the newest usable) of `checkpoint_dir` to `out`; returns the step.

    The model is written whole into a scratch folder beside `out`, with the files of `out` that are not a
    model (a tokenizer's), then renamed into its place (checkpoint.publish): a stale shard or index never
    stays, and a failed export (a full disk) leaves `out` as it was."""
    check_out(out, overwrite)
    step, config, state, _ = read_checkpoint(checkpoint_dir, step)
    out = Path(out).absolute()
    scratch = out.with_name(f"{out.name}.tmp")
    problems = checkpoint.attempt(write_folder, state, config, out, scratch, max_shard_bytes)
    problems = problems or checkpoint.attempt(checkpoint.publish, scratch, out)
    if problems:
        shutil.rmtree(scratch, ignore_errors=True)
        rank0.fail(f"export_hf.py: error: --out {out}: writing the model failed ({problems[0]}): free space "
                   f"there or pass another --out; {out} is as it was", status=1)
    return step


def write_folder(state: dict, config, out: Path, scratch: Path, max_shard_bytes):
    """The model, in a fresh `scratch`, beside copies of what else `out` holds (not a model's files)."""
    checkpoint.fresh_folder(scratch)
    for path in sorted(out.iterdir()) if out.is_dir() else []:
        if path.name != "config.json" and ".safetensors" not in path.name:
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, scratch / path.name)
    hf_io.save_hf_state(state, config, scratch, max_shard_bytes)


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True, help="a --checkpoint-dir of any trainer")
    parser.add_argument("--out", required=True,
                        help="the folder to write config.json and model.safetensors to")
    parser.add_argument("--step", type=int, help="the step to export (default: the newest usable checkpoint)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the model an existing --out holds (its other files are kept)")
    parser.add_argument("--max-shard-mb", type=float, default=5000.0,
                        help="a larger model goes into files of at most this size and an index "
                             "(save_pretrained's 5GB)")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.max_shard_mb) and args.max_shard_mb > 0):
        parser.error(f"--max-shard-mb must be a positive finite number, got {args.max_shard_mb}")
    try:
        step = export(args.checkpoint_dir, args.out, args.step, args.overwrite, args.max_shard_mb * 1e6)
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as error:
        parser.error(str(error))
    print(f"exported step {step} of {args.checkpoint_dir} to {args.out}")


if __name__ == "__main__":
    main()
