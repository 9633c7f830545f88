"""The flags every `NN_*/train.py` shares, one argument group each, and the presets they default to.

cli.core_parser puts the groups together; a later folder adds only its own parallel degrees.
"""
import argparse

import torch

import watchdog

SHAPE = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
# Each preset: its shape, then the flags it sets when they are not given. --lr: the published peak of a model
# of that size (TinyLlama 4e-4; Llama 3's 3e-4), since 3e-3 makes a 1B model's loss climb before it falls.
PRESETS = {
    "tiny": dict(zip(SHAPE, (128, 352, 4, 4, 2)), lr=3e-3),
    "small": dict(zip(SHAPE, (512, 1408, 8, 8, 4)), lr=3e-3),
    # TinyLlama-1.1B, with its 32000-token vocabulary (the byte tokenizer's 257 ids are the first of them)
    "1b": dict(zip(SHAPE, (2048, 5632, 22, 32, 4)), vocab_size=32000, lr=4e-4),
    # Llama-3.2-1B as its config.json has it: tied embeddings, RoPE base 500000 and Llama 3.1's scaling
    "llama3-1b": dict(zip(SHAPE, (2048, 8192, 16, 32, 8)), vocab_size=128256, tie_embeddings=True, lr=3e-4,
                      rope_theta=500000.0, max_position_embeddings=131072,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
ROPE = ("rope_theta", "rope_scaling", "max_position_embeddings")   # preset keys with no flag: the config's
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def default_vocab_size(tokenizer_vocab: int) -> int:
    """An unset --vocab-size (and no preset's): the tokenizer's vocabulary rounded up to a multiple of 64,
    so it divides by any tp and its matmuls tile."""
    return -(-tokenizer_vocab // 64) * 64


def seed(text: str) -> int:
    """--seed's type: 32 bits, as torch's generators and the samplers' seed·stride + index arithmetic take."""
    value = int(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be between 0 and {2**32 - 1}, got {value}")
    return value


def model_flags(g):
    g.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="the model's shape; tiny: h 128, L 4, small: h 512, L 8, 1b: TinyLlama-1.1B's")
    g.add_argument("--hidden-size", type=int, help="h, the model width (default: the preset's)")
    g.add_argument("--intermediate-size", type=int,
                   help="the SwiGLU MLP's inner width (default: the preset's)")
    g.add_argument("--num-layers", type=int, help="L, transformer blocks (default: the preset's)")
    g.add_argument("--num-heads", type=int, help="query heads; head_dim = h / heads (default: the preset's)")
    g.add_argument("--num-kv-heads", type=int,
                   help="key/value heads, at most --num-heads and dividing it (GQA; default: the preset's)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="default: the preset's (1b 32000, llama3-1b 128256), else the tokenizer's vocabulary "
                        "rounded up to a multiple of 64 (divisible by tp)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="the output layer shares the embedding's weight (default: the preset's, llama3-1b "
                        "ties)")
    g.add_argument("--init-from", metavar="HF_DIR",
                   help="start from HF-format weights (config.json + safetensors)")


def schedule_flags(g):
    g.add_argument("--steps", type=int, default=200, help="optimizer steps")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    g.add_argument("--mbs", type=int, default=8, help="micro-batch size (sequences per rank per micro-batch)")
    g.add_argument("--grad-acc", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: the preset's: tiny, small 3e-3, 1b 4e-4, llama3-1b "
                        "3e-4)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr·ratio")
    g.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up to --lr over these steps")
    g.add_argument("--lr-decay-steps", type=int, default=None, metavar="N",
                   help="length of the warmup + cosine schedule (default: --steps); saved with checkpoints, "
                        "so --resume with a larger --steps keeps it (the extra steps run at lr·min-lr-ratio)")
    g.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW's decoupled decay of the matrices and embeddings; norm gains are not decayed")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    g.add_argument("--seed", type=seed, default=1234, help="the initialisation and the data order")


def speed_flags(g):
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="float32/float64: the whole model in that type; bfloat16/float16: autocast (float16 "
                        "with loss scaling); see --precision-layout where the trainer has it")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: one GPU per rank (LOCAL_RANK's), NCCL; cpu: gloo")
    g.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                   help="activation recomputation: selective recomputes only the attention core (Megatron)")
    g.add_argument("--kernels", choices=["torch", "triton"], default="torch",
                   help="RMSNorm, SwiGLU, RoPE and the loss in eager PyTorch or as Triton kernels (kernels/)")
    g.add_argument("--attn", choices=["sdpa", "eager", "triton"], default="sdpa",
                   help="attention core: PyTorch SDPA, written-out softmax, or kernels/flash_attention.py")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (build.py; on the CPU inductor needs a C++ "
                        "compiler)")


def data_flags(g):
    g.add_argument("--dataset", default="stdlib",
                   help="'stdlib' (offline default: Python's own sources), 'synthetic' (uniform random token "
                        "ids of the model's vocabulary, seeded by --seed: for speed runs), a local "
                        ".txt/.md/.py or .jsonl/.json/.parquet file or folder, or an HF hub dataset name "
                        "(needs the network)")
    g.add_argument("--text-column", default="text",
                   help="the column of .jsonl/.json/.parquet/hub records to read")
    g.add_argument("--tokenizer", default="bytes",
                   help="'bytes' (offline default) or an HF tokenizer dir/name")
    g.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="every N steps and after the last, the loss on held-out data (0: no held-out split)")
    g.add_argument("--eval-batches", type=int, default=2, metavar="K",
                   help="global batches held out for evaluation: the data's last K·dp·mbs·grad_acc windows")


def observability_flags(g):
    g.add_argument("--json-log", metavar="PATH", help="one JSON object per optimizer step (rank 0 writes)")
    g.add_argument("--log-every", type=int, default=1,
                   help="print every N-th step (--json-log has every step)")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bar (one log line per step instead)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak for MFU and HFU; default: known GPUs (H100/H200 989, A100 312), none on "
                        "CPU")
    g.add_argument("--profile", metavar="DIR",
                   help="torch.profiler trace of steps 3-5 (wait 1, warm up 1, record 3) into DIR, one file "
                        "per rank, for Perfetto or TensorBoard")
    g.add_argument("--plot", metavar="DIR",
                   help="at the end, loss.png (train and eval loss) and memory.png (model states and "
                        "activations per rank) in DIR")
    g.add_argument("--tensorboard", metavar="DIR",
                   help="TensorBoard event files in DIR (pip install tensorboard)")


def checkpoint_flags(g):
    g.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here (see --checkpoint-every)")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="save every N steps (0: only at the end)")
    g.add_argument("--keep-last", type=int, default=0, metavar="N",
                   help="keep only the newest N checkpoints (0: keep all; a corrupt newest one falls back to "
                        "older)")
    g.add_argument("--resume", nargs="?", const="latest", choices=["latest", "auto"], metavar="auto",
                   help="continue from the newest usable checkpoint in --checkpoint-dir (refused where there "
                        "is none); --resume auto: the same, or a new run where none was saved yet, so a "
                        "requeued job's command works every time")
    g.add_argument("--overwrite", action="store_true",
                   help="start a new run in a --checkpoint-dir that holds another run's checkpoints (they "
                        "are removed once this run has saved its first one)")


def failure_flags(g):
    g.add_argument("--timeout-s", type=float, default=watchdog.DEFAULT_TIMEOUT_S, metavar="S",
                   help="a collective, or a training step, that waits longer than this ends every rank (a "
                        "stalled or dead peer, a deadlock)")
    g.add_argument("--no-memory-check", action="store_true",
                   help="start even where this rank's memory estimate (parameters, gradients, optimizer "
                        "states, activations: a lower bound) exceeds what its device has free")
    g.add_argument("--on-nonfinite", choices=["stop", "skip"], default="stop",
                   help="a NaN/inf loss or gradient norm stops the run, or skips the step (no parameter or "
                        "optimizer-state update)")
