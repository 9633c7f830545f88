"""Export a checkpoint of any parallel layout as a Hugging Face Llama directory.

    python 01_single_gpu/runtime/export_hf.py --checkpoint-dir ckpt --out hf_model [--step N] [--overwrite]

A checkpoint holds every parameter as pieces in global coordinates (global_state.py: name, TP block,
ZeRO flat range), whatever layout saved it: dp × tp × pp × cp, ZeRO-1/2/3. This rebuilds each parameter
from its pieces, one at a time, and writes `config.json` + `model.safetensors` (hf_io.save_hf_state),
which `transformers.LlamaForCausalLM.from_pretrained` loads with the project's logits. A mixture-of-experts
checkpoint (07, 08 --num-experts) is not a Llama: it is refused.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime")]
from pathlib import Path

import json

import checkpoint
import cli
import cli_checks
import global_state
import hf_io
import model as modeling


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


def export(checkpoint_dir, out, step=None, overwrite: bool = False):
    """Write checkpoint `step` (default: the newest usable) of `checkpoint_dir` to `out`; returns the step."""
    check_out(out, overwrite)
    step, config, state, _ = read_checkpoint(checkpoint_dir, step)
    hf_io.save_hf_state(state, config, out)
    return step


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True, help="a --checkpoint-dir of any trainer")
    parser.add_argument("--out", required=True,
                        help="the folder to write config.json and model.safetensors to")
    parser.add_argument("--step", type=int, help="the step to export (default: the newest usable checkpoint)")
    parser.add_argument("--overwrite", action="store_true", help="replace the model an existing --out holds")
    args = parser.parse_args(argv)
    try:
        step = export(args.checkpoint_dir, args.out, args.step, args.overwrite)
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as error:
        parser.error(str(error))
    print(f"exported step {step} of {args.checkpoint_dir} to {args.out} (config.json, model.safetensors)")


if __name__ == "__main__":
    main()
