"""Data: tokenize, pack into windows of seq_len+1 tokens, cache, and sample deterministically.

Plumbing written once and reused by every folder. The default path is fully offline: the corpus is
the Python standard library's own sources (real English-and-code text that every machine with
Python already has), tokenized to bytes. Users can pass local text/jsonl/parquet files or folders and
an HF tokenizer directory, or, online, hub names (sources.py checks what a name points at first).

A build streams: text is tokenized in line-aligned pieces by `datasets.map` (several processes for
big inputs) into arrow files on disk, then copied batch by batch into one memory-mapped .npy of
windows, so memory stays bounded whatever the input size. The cache file is named by a hash of
everything that changes the tokens (files, text column, tokenizer content, seq_len, format).

--dataset synthetic (`SyntheticWindows`) skips all of that: random token ids, drawn per window from --seed.

Which windows each step reads is sampling.py's.
"""
import hashlib
import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

import sources

DEFAULT_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "data"
FORMAT_VERSION = 2                 # bump when the code below would turn the same inputs into other windows
PIECE_CHARS = 2**16                # a text is tokenized in line-aligned pieces of at most this many chars
TEXT_BYTES_PER_PROC = 4 * 2**20    # one tokenizing process per this much text, up to the cores
SYNTHETIC = "synthetic"            # --dataset synthetic: random token ids (SyntheticWindows)
SYNTHETIC_WINDOWS = 2**16          # its length: the sampler's permutation of them stays small


class ByteTokenizer:
    """UTF-8 bytes are the tokens 0..255; 256 marks the end of a document. Needs no download."""
    name = "bytes"
    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> list:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "bytes"   # the two lines above are the whole tokenizer; FORMAT_VERSION covers changes to them


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (or a hub name when online)."""

    def __init__(self, name_or_dir: str):
        from transformers import AutoTokenizer  # optional dependency, only on this path
        try:
            self.tok = AutoTokenizer.from_pretrained(name_or_dir)
        except Exception as error:   # OSError, ValueError, JSON and tokenizers errors alike: a file is broken
            raise ValueError(f"--tokenizer {name_or_dir} could not be loaded ({type(error).__name__}: "
                             f"{sources.first_line(error)}): pass a folder saved with save_pretrained, "
                             f"or 'bytes'") from None
        self.name = name_or_dir
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id

    def encode(self, text: str) -> list:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tok.decode(ids)

    def fingerprint(self) -> str:
        """A hash of what decides the ids, not of the name: the same directory may hold a new vocabulary."""
        if getattr(self.tok, "backend_tokenizer", None) is not None:   # a fast tokenizer: one JSON of it all
            content = self.tok.backend_tokenizer.to_str().encode()
        else:   # a Python tokenizer: the vocabulary/merges/model files it would save
            with tempfile.TemporaryDirectory() as d:
                content = b"".join(Path(f).read_bytes() for f in sorted(self.tok.save_pretrained(d)))
        detail = repr((self.name, type(self.tok).__name__, self.eos_token_id)).encode()
        return hashlib.sha256(detail + content).hexdigest()


def load_tokenizer(name: str):
    return ByteTokenizer() if name == "bytes" else HFTokenizer(name)


def _resolved_stats(files):
    """(resolved path, (size, mtime_ns)) of each file. Path.resolve() walks every folder of the path, so each
    folder is resolved once (the default corpus is ~160 files of one folder) and a file only when it is a
    link itself: the same paths as resolving every file, at a tenth of the cost."""
    folders = {}
    for p in files:
        if p.is_symlink():
            path = p.resolve()
        else:
            if p.parent not in folders:
                folders[p.parent] = p.parent.resolve()
            path = folders[p.parent] / p.name
        stat = p.stat()
        yield path, (stat.st_size, stat.st_mtime_ns)


def _fingerprint(source, kind, files, text_column, tokenizer, seq_len) -> str:
    """The cache key: a hash of everything that changes the windows (a hub dataset is keyed by its name)."""
    key = {"format": FORMAT_VERSION, "hub": source if kind == "hub" else None, "seq_len": seq_len,
           "files": [(str(path), *stat) for path, stat in _resolved_stats(files)],
           "text_column": None if kind == "text" else text_column, "tokenizer": tokenizer.fingerprint()}
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]


def _line_pieces(stream, size: int = PIECE_CHARS):
    """(piece, is_last): consecutive pieces of a text stream, each at most `size` characters and ending at
    a line end (a line longer than `size` is cut inside). The last piece may be empty."""
    piece, n = [], 0
    for line in iter(lambda: stream.readline(size), ""):
        if n + len(line) > size:
            yield "".join(piece), False
            piece, n = [], 0
        piece.append(line)
        n += len(line)
    yield "".join(piece), True


def _text_rows(files):
    """Rows {"text", "last"} of text files: each file is one document, read piece by piece."""
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:   # text mode: line ends normalised
            for piece, last in _line_pieces(f):
                yield {"text": piece, "last": last}


def _records(source, kind, files, text_column, scratch):
    """A `datasets.Dataset` with one column "text" from .jsonl/.json/.parquet files or a hub dataset."""
    import datasets
    try:
        if kind == "hub":
            ds = datasets.load_dataset(source, split="train")
        else:
            ds = datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train",
                                       cache_dir=str(scratch))
    # a record check_source did not peek at, or the hub, is broken: name the source
    except Exception as error:
        cause = error.__cause__ or error
        raise ValueError(f"{source} could not be read as {sources.KIND_NAMES.get(kind, 'a hub dataset')} "
                         f"({type(cause).__name__}: {sources.first_line(cause)}): fix it or pass another "
                         f"--dataset") from None
    if text_column not in ds.column_names:
        raise ValueError(f"{source} has no column {text_column!r} (columns: {ds.column_names}); "
                         f"pass --text-column")
    ds = ds.select_columns([text_column])
    return ds if text_column == "text" else ds.rename_column(text_column, "text")


def _tokenize(batch, tokenizer):
    """Documents, or pieces of one with `last` marking its end, -> int32 ids; EOS closes each document.

    Never one call on a whole document: a BPE tokenizer holds ~1 KB per token while it encodes. Each
    text is encoded in line-aligned pieces instead. Bytes do not depend on the cuts; a BPE tokenizer
    can give other ids at a cut than on the whole text only where a pre-token or merge would span that
    line end (e.g. a run of blank lines that Llama 3 encodes as one token): a token or two per piece.
    """
    eos = np.array([tokenizer.eos_token_id], dtype=np.int32)
    lasts = batch["last"] if "last" in batch else [True] * len(batch["text"])   # records: whole documents
    ids = []
    for text, last in zip(batch["text"], lasts):
        pieces = [np.asarray(tokenizer.encode(p), dtype=np.int32) for p, _ in _line_pieces(io.StringIO(text))]
        ids.append(np.concatenate(pieces + [eos] if last else pieces))
    return {"ids": ids}


def _pack(tokens, window: int, path: Path):
    """Concatenate the tokenized rows and cut them into (N, window) int32 windows in the .npy file `path`
    (the tail that does not fill a window is dropped), batch by batch: no list of all tokens is built."""
    import pyarrow.compute as pc
    from tqdm import tqdm

    def batches():
        return tokens.with_format("arrow").iter(batch_size=256)
    total = sum(pc.sum(pc.list_value_length(b["ids"])).as_py() or 0 for b in batches())
    if total < window:
        raise ValueError(f"the data holds {total} tokens, fewer than seq_len+1={window}: pass more text")
    windows = np.lib.format.open_memmap(path, mode="w+", dtype=np.int32, shape=(total // window, window))
    flat, filled = windows.reshape(-1), 0                      # (N·window,) view of the file
    with tqdm(total=flat.size, unit="tok", unit_scale=True, desc="packing windows") as bar:
        for b in batches():
            ids = b["ids"].combine_chunks().flatten().to_numpy()[: flat.size - filled]
            flat[filled: filled + len(ids)] = ids
            filled += len(ids)
            bar.update(len(ids))
    windows.flush()


def _build(source, kind, files, text_column, tokenizer, window, scratch: Path):
    """Tokenize the source into arrow files under `scratch`, then pack them into scratch/windows.npy."""
    import datasets
    if kind == "text":
        docs = datasets.Dataset.from_generator(_text_rows, gen_kwargs={"files": [str(p) for p in files]},
                                               cache_dir=str(scratch), writer_batch_size=64,
                                               fingerprint="text")
    else:
        docs = _records(source, kind, files, text_column, scratch)
    if len(docs) == 0:
        raise ValueError(f"{source} holds no documents")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    num_proc = max(1, min(cores, len(docs), docs.data.nbytes // TEXT_BYTES_PER_PROC))
    rows_per_batch = int(np.clip(2**20 * len(docs) // max(1, docs.data.nbytes), 1, 1000))   # ~1 MiB of text
    tokens = docs.map(_tokenize, fn_kwargs={"tokenizer": tokenizer}, batched=True,
                      batch_size=rows_per_batch, writer_batch_size=rows_per_batch,
                      remove_columns=docs.column_names, num_proc=num_proc if num_proc > 1 else None,
                      cache_file_name=str(scratch / "tokens.arrow"), new_fingerprint="tokens",
                      desc=f"tokenizing {source}")
    _pack(tokens, window, scratch / "windows.npy")


class TokenWindows:
    """The cached windows, memory-mapped: `len(w)` windows, `w[i]["input_ids"]` a (seq_len+1,) int64."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.windows = np.load(self.path, mmap_mode="r")   # (N, seq_len+1) int32, read from disk on demand

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i].astype(np.int64)}


def build_dataset(source: str, tokenizer, seq_len: int, cache_dir=DEFAULT_CACHE, text_column: str = "text"):
    """The windows of seq_len+1 token ids of `source` (a `TokenWindows`), built once and cached.

    One process builds a given cache at a time (a file lock beside it); concurrent callers (several
    ranks) wait, then read it. The file is written elsewhere and renamed into place, so a half-written
    cache is never read.
    """
    from filelock import FileLock   # comes with torch and datasets
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name} has no EOS token to end documents with: "
                         f"save it with one (eos_token=...)")
    kind, files = sources.check_source(source, text_column, seq_len + 1)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"{_fingerprint(source, kind, files, text_column, tokenizer, seq_len)}.npy"
    if not target.exists():
        with FileLock(f"{target}.lock"):
            if not target.exists():   # not built while this process waited for the lock
                with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f"{target.stem}.build-") as scratch:
                    _build(source, kind, files, text_column, tokenizer, seq_len + 1, Path(scratch))
                    os.replace(Path(scratch) / "windows.npy", target)
    return TokenWindows(target)


class SyntheticWindows:
    """--dataset synthetic: `windows` windows of seq_len+1 token ids drawn uniformly from [0, vocab_size),
    window i from a generator seeded by (seed, i), redrawn whenever it is read. Nothing is read, tokenized,
    downloaded or cached, and every folder and layout reads the same windows. For speed runs: no token
    predicts the next, so the loss cannot go below ln(vocab_size)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, windows: int = SYNTHETIC_WINDOWS):
        self.vocab_size, self.seq_len, self.seed, self.windows = vocab_size, seq_len, seed, windows

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.windows:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * self.windows + i)
        return {"input_ids": torch.randint(self.vocab_size, (self.seq_len + 1,), generator=g).numpy()}
