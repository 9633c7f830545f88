"""The command-line contract shared by every `NN_*/train.py`, and the checks that run before training.

Defined once here (the flags themselves in flags.py); a later folder calls `core_parser()` and adds
only its own parallel degrees (`--dp`, `--tp`, ...). Same seed and same global batch (dp·mbs·grad_acc
sequences of seq_len tokens) give the same losses in every folder and every parallel layout.

A mistake ends the run before any process group exists, in one line that names the fix (exit status 2;
under torchrun only rank 0 prints it): `parse_args` checks the values, the paths the run will write, the
data source, the tokenizer and `--init-from` directory (without loading them) and the checkpoint to resume
(cli_checks.py); `setup` then loads the tokenizer, makes the model config, checks the trainer's layout
and builds the data.
"""
import argparse
import difflib
import sys
import uuid

import cli_checks as checks
import data
import flags
import hf_io
import model as modeling
import rank0

# The earliest folder whose trainer has the flag (08 has all but 03's --offload), named where one lacks it
FLAG_OWNERS = {"--dp": "02_data_parallel", "--zero-stage": "03_zero", "--offload": "03_zero",
               "--tp": "04_tensor_parallel", "--sp": "05_sequence_context_parallel",
               "--cp": "05_sequence_context_parallel", "--pp": "06_pipeline", "--ep": "07_expert_parallel",
               "--num-experts": "07_expert_parallel"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors (`fail`: no usage block), suggesting a flag for a typo, or the
    folder whose trainer has it."""

    def error(self, message):
        rank0.fail(f"{self.prog}: error: {message}")

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


def core_parser(description: str) -> argparse.ArgumentParser:
    """The flags of every trainer, one argument group each (--help shows them under these headings)."""
    parser = ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags.model_flags(parser.add_argument_group("model (a Llama; explicit sizes override the preset)"))
    flags.schedule_flags(parser.add_argument_group("batch and schedule"))
    flags.speed_flags(parser.add_argument_group("device, precision and speed"))
    flags.data_flags(parser.add_argument_group("data and held-out evaluation"))
    flags.observability_flags(parser.add_argument_group("logging and observability"))
    flags.checkpoint_flags(parser.add_argument_group("checkpoints"))
    flags.failure_flags(parser.add_argument_group("failures"))
    return parser


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
        rank0.print0(f"nothing to do: {args.checkpoint_dir} holds step {args.resume_step}, and --steps is "
                     f"{args.steps}; pass a larger --steps to train on")
        sys.exit(0)
    return args


def completed(given: argparse.Namespace) -> argparse.Namespace:
    """The parsed flags, checked, with what they leave open filled in: the preset's sizes, this run's id."""
    preset = {name: value for name, value in {"tie_embeddings": False, **flags.PRESETS[given.preset]}.items()
              if name not in flags.ROPE and getattr(given, name) is None}
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
        vocab = args.vocab_size or flags.default_vocab_size(tokenizer_vocab)
        rope = {k: v for k, v in flags.PRESETS[args.preset].items() if k in flags.ROPE}
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
