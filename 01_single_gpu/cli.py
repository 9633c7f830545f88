"""The command-line contract shared by every `NN_*/train.py`.

Defined once here; a later folder calls `core_parser()` and adds only its own parallel degrees
(`--dp`, `--tp`, ...). Same seed and same global batch (dp·mbs·grad_acc sequences of seq_len
tokens) give the same losses in every folder and every parallel layout.
"""
import argparse
from importlib import import_module

import torch

PRESETS = {  # hidden, intermediate, layers, heads, kv heads
    "tiny": (128, 352, 4, 4, 2),
    "small": (512, 1408, 8, 8, 4),
    "1b": (2048, 5632, 22, 32, 4),   # TinyLlama-1.1B's shape; ~1.0B parameters with the byte vocabulary
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def core_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model (a Llama; explicit sizes override the preset)")
    m.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--intermediate-size", type=int)
    m.add_argument("--num-layers", type=int)
    m.add_argument("--num-heads", type=int)
    m.add_argument("--num-kv-heads", type=int)
    m.add_argument("--vocab-size", type=int, default=None,
                   help="default: the tokenizer's vocabulary rounded up to a multiple of 64 (divisible by tp)")
    m.add_argument("--tie-embeddings", action="store_true")
    m.add_argument("--init-from", metavar="HF_DIR", help="start from HF-format weights (config.json + safetensors)")

    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=200, help="optimizer steps")
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--mbs", type=int, default=8, help="micro-batch size (sequences per rank per micro-batch)")
    t.add_argument("--grad-acc", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr·ratio")
    t.add_argument("--warmup-steps", type=int, default=10)
    t.add_argument("--lr-decay-steps", type=int, default=None, metavar="N",
                   help="length of the warmup + cosine schedule (default: --steps); saved with checkpoints, so "
                        "--resume with a larger --steps keeps it (the extra steps run at lr·min-lr-ratio)")
    t.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW's decoupled decay of the matrices and embeddings; norm gains are not decayed")
    t.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="float32/float64: the whole model in that type; bfloat16: fp32 master weights + bf16 autocast")
    t.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    t.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                   help="activation recomputation: selective recomputes only the attention core (Megatron)")
    t.add_argument("--kernels", choices=["torch", "triton"], default="torch",
                   help="RMSNorm, SwiGLU, RoPE and the loss in eager PyTorch or as Triton kernels (kernels/)")
    t.add_argument("--attn", choices=["sdpa", "eager", "triton"], default="sdpa",
                   help="attention core: PyTorch SDPA, written-out softmax, or kernels/flash_attention.py")

    d = p.add_argument_group("data")
    d.add_argument("--dataset", default="stdlib",
                   help="'stdlib' (offline default: Python's own sources), a local .txt/.md/.py or "
                        ".jsonl/.json/.parquet file or folder, or an HF hub dataset name (needs the network)")
    d.add_argument("--text-column", default="text", help="the column of .jsonl/.json/.parquet/hub records to read")
    d.add_argument("--tokenizer", default="bytes", help="'bytes' (offline default) or an HF tokenizer dir/name")

    o = p.add_argument_group("logging and checkpoints")
    o.add_argument("--json-log", metavar="PATH", help="one JSON object per optimizer step (rank 0 writes)")
    o.add_argument("--log-every", type=int, default=1)
    o.add_argument("--no-progress", action="store_true", help="no tqdm bar (one log line per step instead)")
    o.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak for MFU; default: known GPUs (H100/H200 989, A100 312), none on CPU")
    o.add_argument("--checkpoint-dir", metavar="DIR")
    o.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="save every N steps (0: only at the end)")
    o.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    return p


def parse_args(parser, argv=None):
    args = parser.parse_args(argv)
    preset = dict(zip(("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"),
                      PRESETS[args.preset]))
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.num_kv_heads > args.num_heads:  # a preset's kv heads with fewer explicit heads
        args.num_kv_heads = args.num_heads
    for name in ("steps", "seq_len", "mbs", "grad_acc") + (("lr_decay_steps",) if args.lr_decay_steps else ()):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible; use --device cpu")
    return args


def setup(parser, argv=None, check_layout=None):
    """(args, model config, dataset): everything a run must know before any process group exists.

    Parses and checks the flags, loads the tokenizer, makes the model config, runs the trainer's
    `check_layout(args, config)` (its parallel degrees against the model and the world size), then builds
    or reads the data windows. A mistake in any of them exits at once with one line naming the fix.
    """
    args = parse_args(parser, argv)
    data = import_module("01_single_gpu.data")
    try:
        tokenizer = data.load_tokenizer(args.tokenizer)
        config = model_config(args, tokenizer.vocab_size)
        if check_layout is not None:
            check_layout(args, config)
        dataset = data.build_dataset(args.dataset, tokenizer, args.seq_len, text_column=args.text_column)
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    return args, config, dataset


def model_config(args, tokenizer_vocab: int):
    """The LlamaConfig the flags describe (or the one stored with --init-from)."""
    model_mod, hf_io = import_module("01_single_gpu.model"), import_module("01_single_gpu.hf_io")
    if args.init_from:
        config = hf_io.config_from_hf(args.init_from, model_mod.LlamaConfig)
    else:
        vocab = args.vocab_size or -(-tokenizer_vocab // 64) * 64
        config = model_mod.LlamaConfig(
            vocab_size=vocab, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
            num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
            num_key_value_heads=args.num_kv_heads, tie_word_embeddings=args.tie_embeddings,
            max_position_embeddings=max(4096, args.seq_len))
    if config.vocab_size < tokenizer_vocab:
        raise ValueError(f"vocab_size={config.vocab_size} is smaller than the tokenizer's {tokenizer_vocab}")
    return config
