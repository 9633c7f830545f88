"""The command-line contract shared by every `NN_*/train.py`, and the checks that run before training.

Defined once here; a later folder calls `core_parser()` and adds only its own parallel degrees
(`--dp`, `--tp`, ...). Same seed and same global batch (dp·mbs·grad_acc sequences of seq_len
tokens) give the same losses in every folder and every parallel layout.

A mistake ends the run before any process group exists, in one line that names the fix (exit status 2;
under torchrun only rank 0 prints it): `parse_args` checks the values, the paths the run will write, the
data source, the tokenizer and `--init-from` directory (without loading them) and the checkpoint to resume
(cli_checks.py); `setup` then loads the tokenizer, makes the model config, checks the trainer's layout
and builds the data.
"""
import argparse
import difflib
import os
import sys
import time
import uuid

import torch

import cli_checks as checks
import data
import hf_io
import model as modeling
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


# The earliest folder whose trainer has the flag (08 has all but 03's --offload), named where one lacks it
FLAG_OWNERS = {"--dp": "02_data_parallel", "--zero-stage": "03_zero", "--offload": "03_zero",
               "--tp": "04_tensor_parallel", "--sp": "05_sequence_context_parallel",
               "--cp": "05_sequence_context_parallel", "--pp": "06_pipeline", "--ep": "07_expert_parallel",
               "--num-experts": "07_expert_parallel"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors (`fail`: no usage block), suggesting a flag for a typo, or the
    folder whose trainer has it."""

    def error(self, message):
        fail(f"{self.prog}: error: {message}")

    def parse_args(self, args=None, namespace=None):
        args, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = [option for action in self._actions for option in action.option_strings]
            typo = next((e.split("=")[0] for e in extras if e.startswith("--")), "")
            close = difflib.get_close_matches(typo, flags, n=1)
            hint = (f"(a flag of {FLAG_OWNERS[typo]}/train.py: run {FLAG_OWNERS[typo]}/train.py "
                    f"{' '.join(extras)})" if typo in FLAG_OWNERS else
                    f"(did you mean {close[0]}?)" if close else "(see --help)")
            self.error(f"unrecognized arguments: {' '.join(extras)} {hint}")
        return args


def seed(text: str) -> int:
    """--seed's type: 32 bits, as torch's generators and the samplers' seed·stride + index arithmetic take."""
    value = int(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be between 0 and {2**32 - 1}, got {value}")
    return value


def fail(line: str, status: int = 2):
    """Exit with `line`, printed once: by rank 0 of a torchrun job (every rank finds the same mistake).

    torchrun still prints its summary of the failed workers; rank 0 also writes the line into the error
    file torchrun gives each worker (TORCHELASTIC_ERROR_FILE), so that summary names it as the root cause.
    Under torchrun the other ranks wait (at most 10 s) before exiting: the first worker to fail makes
    torchrun stop the rest, and a silent rank leaving first could stop rank 0 before it printed the line.
    """
    line = " ".join(line.splitlines())
    print0(line, file=sys.stderr)
    if int(os.environ.get("RANK", 0)) == 0:
        watchdog.record_for_torchrun(line)
    elif os.environ.get("TORCHELASTIC_ERROR_FILE"):
        time.sleep(10)
    sys.exit(status)


def print0(*args, **kwargs):
    """print on rank 0 only (every rank of a job checks the same flags: one says what they found)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def core_parser(description: str) -> argparse.ArgumentParser:
    """The flags of every trainer, one argument group each (--help shows them under these headings)."""
    parser = ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model_flags(parser.add_argument_group("model (a Llama; explicit sizes override the preset)"))
    schedule_flags(parser.add_argument_group("batch and schedule"))
    speed_flags(parser.add_argument_group("device, precision and speed"))
    data_flags(parser.add_argument_group("data and held-out evaluation"))
    observability_flags(parser.add_argument_group("logging and observability"))
    checkpoint_flags(parser.add_argument_group("checkpoints"))
    failure_flags(parser.add_argument_group("failures"))
    return parser


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


def parse_args(parser, argv=None, files: bool = True):
    """The flags, checked: every value and (`files`) every file they name that can be checked unloaded.

    Runs on every rank before any process group exists, so a mistake is one line from rank 0, not a hang.
    With --resume it also picks the checkpoint to continue from (`args.resume_step`, the newest one whose
    files match their checksums) and exits 0 if that one already reached --steps. `files=False` checks the
    values only (08's planner, which reads no data and only the shapes of --init-from's config.json).
    """
    given = parser.parse_args(argv)
    try:
        args = completed(given)
        if files:
            args = with_values(args, **checks.check_inputs(args))
    except ValueError as error:
        parser.error(str(error))
    if args.resume and args.resume_step >= args.steps:
        print0(f"nothing to do: {args.checkpoint_dir} holds step {args.resume_step}, and --steps is "
               f"{args.steps}; pass a larger --steps to train on")
        sys.exit(0)
    return args


def completed(given: argparse.Namespace) -> argparse.Namespace:
    """The parsed flags, checked, with what they leave open filled in: the preset's sizes, this run's id."""
    preset = {name: value for name, value in {"tie_embeddings": False, **PRESETS[given.preset]}.items()
              if name not in ROPE and getattr(given, name) is None}
    # rank 0's run id is the one its manifests record; --resume takes the checkpoint's
    args = with_values(given, **preset, run_id=uuid.uuid4().hex[:12], resume_step=0)
    checks.check_values(args)
    if args.num_kv_heads > args.num_heads and given.num_kv_heads is not None:
        raise ValueError(f"--num-kv-heads {args.num_kv_heads} is more than --num-heads {args.num_heads}: "
                         f"each key/value head serves a group of query heads; pass at most {args.num_heads}")
    # a preset's kv heads with fewer explicit heads: one per query head
    kv_heads = min(args.num_kv_heads, args.num_heads)
    if not args.init_from:                         # --init-from's config.json gives the shape instead
        checks.check_heads(args.hidden_size, args.num_heads, kv_heads)
    # no held-out split: training reads the whole dataset (--resume compares it)
    return with_values(args, num_kv_heads=kv_heads, eval_batches=args.eval_batches if args.eval_every else 0)


def with_values(args: argparse.Namespace, **values) -> argparse.Namespace:
    """A new namespace: `args` with `values` (parse_args builds the flags once; nothing writes into them)."""
    return argparse.Namespace(**{**vars(args), **values})


def setup(parser, argv=None, check_layout=None):
    """(args, model config, dataset): everything a run must know before any process group exists.

    Parses and checks the flags (`parse_args`), loads the tokenizer, makes the model config, runs the
    trainer's `check_layout(args, config)` (its parallel degrees against the model and the world size),
    then builds or reads the data windows. A mistake in any of them exits at once with one line naming
    the fix.
    """
    args = parse_args(parser, argv)
    try:
        tokenizer = data.load_tokenizer(args.tokenizer)
        config = model_config(args, tokenizer.vocab_size)
        if check_layout is not None:
            check_layout(args, config)
        if not args.no_memory_check:          # before the data, the model and any process group
            checks.check_memory(args, config)
        if args.dataset == data.SYNTHETIC:
            dataset = data.SyntheticWindows(config.vocab_size, args.seq_len, args.seed)
        else:
            dataset = data.build_dataset(args.dataset, tokenizer, args.seq_len, text_column=args.text_column)
        held_out = args.eval_batches * checks.global_batch_of(args)
        if held_out and held_out >= len(dataset):
            raise ValueError(f"--eval-batches {args.eval_batches} holds out {held_out} of the {len(dataset)} "
                             f"windows of {args.dataset}, leaving none to train on: lower --eval-batches")
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    return args, config, dataset


def model_config(args, tokenizer_vocab: int):
    """The LlamaConfig the flags describe (or the one stored with --init-from)."""
    if args.init_from:
        config = hf_io.config_from_hf(args.init_from, modeling.LlamaConfig)
    else:
        vocab = args.vocab_size or -(-tokenizer_vocab // 64) * 64
        rope = {k: v for k, v in PRESETS[args.preset].items() if k in ROPE}
        config = modeling.LlamaConfig(
            vocab_size=vocab, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
            num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
            num_key_value_heads=args.num_kv_heads, tie_word_embeddings=args.tie_embeddings,
            **{**rope,
               "max_position_embeddings": max(rope.get("max_position_embeddings", 4096), args.seq_len)})
    # synthetic ids are drawn from the model's own vocabulary: no tokenizer's ids have to fit in it
    if config.vocab_size < tokenizer_vocab and args.dataset != data.SYNTHETIC:
        raise ValueError(f"vocab_size={config.vocab_size} is smaller than the tokenizer's {tokenizer_vocab}: "
                         f"pass --vocab-size {tokenizer_vocab} or more")
    return config
