"""Data: tokenize, pack into windows of seq_len+1 tokens, cache, and sample deterministically.

Plumbing written once and reused by every folder. The default path is fully offline: the corpus is
the Python standard library's own sources (real English-and-code text that every machine with
Python already has), tokenized to bytes. Users who are online can pass local text/jsonl/parquet
files, an HF hub dataset name, and an HF tokenizer directory or name.

Sampling is a pure function of (seed, step): the global batch of step s is the samples
[s·G, (s+1)·G) of a seeded permutation per epoch, with G = dp·mbs·grad_acc. Data-parallel rank r
reads its own M rows of each micro-batch, so `--dp D --mbs M` sees exactly the global batch of
`--mbs D·M` on one device, and resuming only needs the step number.
"""
import hashlib
import os
import sysconfig
import uuid
from pathlib import Path

import numpy as np
import torch

DEFAULT_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "data"
DEFAULT_CORPUS_BYTES = 4 * 2**20   # 4 MiB of standard-library sources: ~4M byte tokens


class ByteTokenizer:
    """UTF-8 bytes are the tokens 0..255; 256 marks the end of a document. Needs no download."""
    name = "bytes"
    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> list:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (or a hub name when online)."""

    def __init__(self, name_or_dir: str):
        from transformers import AutoTokenizer  # optional dependency, only on this path
        self.tok = AutoTokenizer.from_pretrained(name_or_dir)
        self.name = name_or_dir
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id

    def encode(self, text: str) -> list:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tok.decode(ids)


def load_tokenizer(name: str):
    return ByteTokenizer() if name == "bytes" else HFTokenizer(name)


def default_corpus_files(limit_bytes: int = DEFAULT_CORPUS_BYTES) -> list:
    """The top-level standard-library modules in sorted order, up to `limit_bytes`."""
    files, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total >= limit_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    return files


def _load_texts(source: str, text_column: str):
    """A `datasets.Dataset` with one column "text" for the named source."""
    import datasets
    if source == "stdlib":
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in default_corpus_files()]
        return datasets.Dataset.from_dict({"text": texts})
    path = Path(source)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix in (".txt", ".md", ".py"))
        return datasets.Dataset.from_dict({"text": [Path(f).read_text(errors="replace") for f in files]})
    if path.suffix in (".txt", ".md"):
        return datasets.Dataset.from_dict({"text": [path.read_text(errors="replace")]})
    if path.suffix in (".jsonl", ".json", ".parquet"):
        kind = "parquet" if path.suffix == ".parquet" else "json"
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    else:  # an HF hub dataset name, e.g. "roneneldan/TinyStories" (needs the network)
        ds = datasets.load_dataset(source, split="train")
    if text_column not in ds.column_names:
        raise ValueError(f"{source} has no column {text_column!r} (columns: {ds.column_names}); "
                         f"pass --text-column")
    return ds.select_columns([text_column]).rename_column(text_column, "text") if text_column != "text" else ds


def _fingerprint(source: str, tokenizer, seq_len: int) -> str:
    if source == "stdlib":
        detail = [(p.name, p.stat().st_size) for p in default_corpus_files()]
    elif Path(source).exists():
        detail = [(str(Path(source).resolve()), Path(source).stat().st_mtime)]
    else:
        detail = source
    return hashlib.sha1(repr((source, detail, tokenizer.name, seq_len)).encode()).hexdigest()[:16]


def build_dataset(source: str, tokenizer, seq_len: int, cache_dir=DEFAULT_CACHE, text_column: str = "text"):
    """Windows of seq_len+1 token ids (a `datasets.Dataset`, numpy format), built once and cached.

    Concurrent builders (several ranks) each write a private directory and rename it into place,
    so a half-written cache is never read.
    """
    import datasets
    datasets.disable_progress_bars()
    target = Path(cache_dir) / f"{_fingerprint(source, tokenizer, seq_len)}"
    if not target.exists():
        window = seq_len + 1

        def tokenize(batch):  # documents -> token ids, each document closed by EOS
            return {"ids": [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in batch["text"]]}

        def pack(batch):  # concatenate documents and cut into windows (the tail that does not fit is dropped)
            flat = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in batch["ids"]])
            n = len(flat) // window
            return {"input_ids": flat[: n * window].reshape(n, window).tolist()}

        texts = _load_texts(source, text_column)
        tokens = texts.map(tokenize, batched=True, remove_columns=texts.column_names)
        packed = tokens.map(pack, batched=True, batch_size=len(tokens), remove_columns=["ids"])
        if len(packed) == 0:
            raise ValueError(f"{source} holds fewer than seq_len+1={window} tokens")
        scratch = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex}")
        packed.save_to_disk(str(scratch))
        try:
            os.rename(scratch, target)
        except OSError:  # another rank finished first; its copy is identical
            import shutil
            shutil.rmtree(scratch, ignore_errors=True)
    return datasets.load_from_disk(str(target)).with_format("numpy")


class GlobalBatchSampler:
    """Which windows each (step, micro-batch, data-parallel rank) reads; a pure function of the seed."""

    def __init__(self, dataset, seed: int, mbs: int, grad_acc: int, dp_size: int = 1):
        self.dataset, self.seed = dataset, seed
        self.mbs, self.grad_acc, self.dp_size = mbs, grad_acc, dp_size
        self.global_batch = mbs * grad_acc * dp_size
        self._perm_epoch, self._perm = None, None

    def _index(self, sample: int) -> int:
        epoch, i = divmod(sample, len(self.dataset))
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self.dataset), generator=g), epoch
        return int(self._perm[i])

    def micro_batch(self, step: int, micro: int, dp_rank: int = 0):
        """(inputs, labels), each (mbs, seq_len) int64: rows of the global batch of `step`."""
        first = step * self.global_batch + (micro * self.dp_size + dp_rank) * self.mbs
        rows = [self._index(s) for s in range(first, first + self.mbs)]
        windows = torch.from_numpy(np.stack([self.dataset[r]["input_ids"] for r in rows]))  # (mbs, T+1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
