"""Sample text from a trained model: a checkpoint of any parallel layout, or a Hugging Face Llama directory.

Autoregressive decoding: each new token is drawn from the last position's logits z, as
p = softmax(z / τ) over the top-k tokens (τ = --temperature, 0: greedy argmax; --top-k 0: all tokens).
With the KV cache (the default) every layer keeps the keys and values of the tokens so far, so a step
feeds only the new token: T·(prompt) + 1 per token instead of recomputing the whole prefix, whose
attention costs grow as T². The cache is applied from outside, like every other change to 01's model:
`KVCache` replaces each layer's attention core (`Attention.attn_fn`) and the new token's position goes
in as `position_ids`, so the training code is untouched.

    python 01_single_gpu/runtime/generate.py --checkpoint-dir ckpt --prompt "def main(" --max-new-tokens 200
    python 01_single_gpu/runtime/generate.py --hf-dir path/to/llama --prompt "The capital of France is"

A checkpoint is rebuilt from its pieces (export_hf.read_checkpoint, any layout's), and decoded with the
tokenizer of the run that saved it; an HF directory with its own tokenizer files, else with --tokenizer.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime")]
from pathlib import Path

import contextlib
import json
import math

import torch
import torch.nn.functional as F

import cli
import data
import export_hf
import flags
import hf_io
import model as modeling


class KVCache:
    """One layer's keys and values of every token so far, used as that layer's attention core."""

    def __init__(self):
        self.k = self.v = None

    def __call__(self, q, k, v):   # q (B, nh, t, hd) of the t new tokens, k/v (B, nkv, t, hd), RoPE applied
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)           # (B, nkv, S, hd)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        groups = q.shape[1] // k.shape[1]
        keys = self.k.repeat_interleave(groups, dim=1)                             # (B, nh, S, hd)
        values = self.v.repeat_interleave(groups, dim=1)
        S, t = keys.shape[2], q.shape[2]
        # new token i is at position S − t + i and sees the keys at positions 0 … S − t + i
        mask = torch.ones(t, S, dtype=torch.bool, device=q.device).tril(diagonal=S - t)    # (t, S)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)    # (B, nh, t, hd)


@contextlib.contextmanager
def kv_cache(model):
    """Every layer's attention core is a fresh KVCache inside the block, the model's own one after it."""
    attentions = [layer.self_attn for layer in model.model.layers]
    saved = [a.attn_fn for a in attentions]
    for a in attentions:
        a.attn_fn = KVCache()
    try:
        yield
    finally:
        for a, fn in zip(attentions, saved):
            a.attn_fn = fn


def next_token(logits, temperature: float, top_k: int, generator=None):
    """(B, V) logits -> (B, 1) ids: argmax at temperature 0, else a draw from softmax(z/τ) of the top k."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]    # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(model, ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, use_cache=True,
             generator=None, eos_token_id=None):
    """ids (B, T) -> (B, T + n): the prompt and up to max_new_tokens sampled tokens (stops at EOS)."""
    with kv_cache(model) if use_cache else contextlib.nullcontext():
        logits = model(ids)[:, -1]                                    # the prompt at once (prefill): (B, V)
        for _ in range(max_new_tokens):
            token = next_token(logits, temperature, top_k, generator)                  # (B, 1)
            ids = torch.cat([ids, token], dim=1)
            if eos_token_id is not None and bool((token == eos_token_id).all()):
                break
            if use_cache:   # only the new token; its position is the sequence's last
                logits = model(token, position_ids=torch.arange(ids.shape[1] - 1, ids.shape[1],
                                                                device=ids.device))[:, -1]
            else:           # the whole sequence again
                logits = model(ids)[:, -1]
    return ids


def load(checkpoint_dir=None, hf_dir=None, tokenizer=None, step=None):
    """(model, tokenizer name) from a checkpoint of any layout or from an HF directory."""
    if checkpoint_dir:
        _, config, state, manifest = export_hf.read_checkpoint(checkpoint_dir, step)
        model = modeling.LlamaForCausalLM(config)
        model.load_state_dict(state)
        return model.eval(), tokenizer or manifest["args"].get("tokenizer", "bytes")
    hf_io.check_hf_dir(hf_dir, modeling.LlamaConfig, modeling.LlamaForCausalLM, "--hf-dir")
    model = modeling.LlamaForCausalLM(hf_io.config_from_hf(hf_dir, modeling.LlamaConfig))
    hf_io.load_hf_into(model, hf_dir)
    has_tokenizer = any((Path(hf_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    return model.eval(), tokenizer or (str(hf_dir) if has_tokenizer else "bytes")


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint-dir", help="a --checkpoint-dir of any trainer (the newest usable step)")
    source.add_argument("--hf-dir", help="a Hugging Face Llama directory (config.json + safetensors)")
    parser.add_argument("--step", type=int, help="the checkpoint step (default: the newest usable)")
    parser.add_argument("--tokenizer", help="default: the run's (checkpoint) or the directory's, else bytes")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy (argmax)")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--no-kv-cache", action="store_true", help="recompute the whole prefix every token")
    parser.add_argument("--seed", type=flags.seed, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    if (not math.isfinite(args.temperature) or args.temperature < 0 or args.top_k < 0
            or args.max_new_tokens < 0):
        parser.error(f"--temperature (a finite number), --top-k and --max-new-tokens must be 0 or more, got "
                     f"{args.temperature}, {args.top_k} and {args.max_new_tokens}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible; use --device cpu")
    try:
        model, tokenizer_name = load(args.checkpoint_dir, args.hf_dir, args.tokenizer, args.step)
        tokenizer = data.load_tokenizer(tokenizer_name)
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as error:
        parser.error(str(error))
    ids = torch.tensor([tokenizer.encode(args.prompt)], device=args.device)     # (1, T)
    if ids.shape[1] == 0:
        parser.error("--prompt is empty: give the model some text to continue")
    if int(ids.max()) >= model.config.vocab_size:      # a --dataset synthetic model of a smaller vocabulary
        vocab = model.config.vocab_size
        parser.error(f"--prompt: its token id {int(ids.max())} is outside the model's vocabulary of {vocab} "
                     f"ids: pass a prompt whose ids are below {vocab}")
    generator = torch.Generator(args.device).manual_seed(args.seed)
    out = generate(model.to(args.device), ids, args.max_new_tokens, args.temperature, args.top_k,
                   use_cache=not args.no_kv_cache, generator=generator, eos_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(out[0].tolist())
    print(text)
    return out


if __name__ == "__main__":
    main()
