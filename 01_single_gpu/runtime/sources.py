"""What --dataset and --tokenizer name, checked before anything is loaded (plumbing, not a technique).

A name is the default corpus ('stdlib': the Python standard library's own top-level modules, so the
losses of a run depend on the Python version that supplies them), a local file or folder, or a
Hugging Face hub name ("name" or "owner/name"). Local sources are sorted into text files (one document
each) and record files (.jsonl/.json/.parquet, one document per record, read from --text-column); the
first record is peeked at, so a file that is not JSON or lacks the column fails in one line before any
tokenizer or build runs. A hub name that is neither in the local hub cache nor reachable (HF_HUB_OFFLINE,
or no connection within HUB_PROBE_S seconds) fails at once with "offline": the libraries themselves retry
for 30-60 s before failing with a page of traceback. data.py builds the windows from what this returns.
"""
import functools
import json
import os
import socket
import sysconfig
import threading
from pathlib import Path
from urllib.parse import urlparse

DEFAULT_CORPUS_BYTES = 4 * 2**20   # 4 MiB of standard-library sources: ~4M byte tokens
KINDS = {".txt": "text", ".md": "text", ".py": "text",
         ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
KIND_NAMES = {"text": "text files (.txt/.md/.py)", "json": "JSON records (.jsonl/.json)",
              "parquet": "Parquet records (.parquet)"}
# A name ending in one of these is a local file, never a hub name ("name" or "owner/name").
FILE_SUFFIXES = {*KINDS, ".csv", ".tsv", ".arrow", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".xml",
                 ".html", ".xlsx", ".pdf", ".npy"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
HUB_PROBE_S = 3.0                  # how long a hub name may wait for a TCP connection before "offline"


def first_line(error) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


def looks_local(name: str) -> bool:
    """A path, not a hub name: it starts with . / ~, ends with /, has two slashes or more, or a file
    suffix."""
    return (name.startswith((".", "/", "~")) or name.endswith("/") or name.count("/") > 1 or "\\" in name
            or Path(name).suffix.lower() in FILE_SUFFIXES)


def hub_unreachable(repo_id: str, repo_type: str) -> bool:
    """True when a hub repository can be neither read from the local hub cache nor downloaded (HF_HUB_OFFLINE,
    or no TCP connection to the hub within HUB_PROBE_S): the libraries would retry for 30-60 s, then fail
    with a page of traceback."""
    from huggingface_hub import constants
    if (Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}").is_dir():
        return False
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True
    url = urlparse(constants.ENDPOINT)
    reached = []

    def probe():   # in a thread: a resolver without network can block far longer than the socket timeout
        try:
            socket.create_connection((url.hostname, url.port or 443), timeout=HUB_PROBE_S).close()
            reached.append(True)
        except OSError:
            pass
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_S + 0.5)
    return not reached


def check_tokenizer(name: str):
    """--tokenizer names 'bytes', a local folder holding a tokenizer, or a hub name that can be reached."""
    if name == "bytes":
        return
    path = Path(name)
    if path.is_dir():
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(f"--tokenizer {name} holds no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}): "
                             f"save one there with save_pretrained, or pass 'bytes'")
    elif path.exists() or looks_local(name):
        raise ValueError(f"--tokenizer {name}: no such folder: pass a folder saved with save_pretrained, "
                         f"a hub name (online), or 'bytes'")
    elif hub_unreachable(name, "model"):
        raise ValueError(f"--tokenizer {name}: not a local folder, and the Hugging Face hub is unreachable "
                         f"(offline: pass a local directory saved with save_pretrained, or 'bytes')")


@functools.cache   # listed once per process: the standard library does not change under a run
def default_corpus_files(limit_bytes: int = DEFAULT_CORPUS_BYTES) -> tuple:
    """The top-level standard-library modules in sorted order, up to `limit_bytes`."""
    files, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total >= limit_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    return tuple(files)


def source_files(source: str):
    """(kind, files) of a source: "text"/"json"/"parquet" with its files in sorted order, or ("hub", [])."""
    if source == "stdlib":
        return "text", default_corpus_files()
    path = Path(source)
    if path.is_dir():   # every supported file below it, hidden ones (.git, .ipynb_checkpoints) left out
        files = [p for p in sorted(path.rglob("*"), key=str) if p.is_file() and p.suffix in KINDS
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
    elif path.is_file():
        if path.suffix not in KINDS:
            raise ValueError(f"{source}: {path.suffix or 'suffix-less'} files are not read: convert it to "
                             f".jsonl or .parquet (records, --text-column) or .txt (one document) and pass "
                             f"that")
        files = [path]
    elif looks_local(source):
        raise ValueError(f"{source} does not exist: pass --dataset an existing file or folder")
    elif hub_unreachable(source, "dataset"):   # else an HF hub dataset name, e.g. "roneneldan/TinyStories"
        raise ValueError(f"--dataset {source}: not a local file or folder, and the Hugging Face hub is "
                         f"unreachable (offline: pass a local directory or file)")
    else:
        return "hub", []
    kinds = {KINDS.get(p.suffix) for p in files}
    if not files or None in kinds:
        raise ValueError(f"{source}: no .txt/.md/.py or .jsonl/.json/.parquet files there; "
                         f"pass --dataset such a file or a folder of them")
    kinds = [k for k in KIND_NAMES if k in kinds]
    if len(kinds) > 1:
        raise ValueError(f"{source} mixes {KIND_NAMES[kinds[0]]} with {KIND_NAMES[kinds[1]]}: "
                         f"split them into two folders and pass one")
    return kinds[0], files


def check_source(source: str, text_column: str = "text", window: int = 1):
    """(kind, files) of --dataset, refused in one line if it cannot be read: a missing or unsupported file,
    an unreachable hub name, records whose first one is not JSON or lacks a text column, or files too small
    for one window of `window` tokens (a token holds a character or more, plus one EOS per file: an upper
    bound). Cheap: no tokenizer, no build (a later bad record still fails the build, with the file named)."""
    kind, files = source_files(source)
    if kind == "json":
        _peek_json(files, text_column)
    elif kind == "parquet":
        import pyarrow.parquet as pq
        for path in files:
            try:
                schema = pq.read_schema(path)
            except Exception as error:   # pyarrow's ArrowInvalid/OSError: not a Parquet file, or a torn one
                raise ValueError(f"{path} is not a Parquet file ({first_line(error)}): fix it or pass "
                                 f"another --dataset") from None
            if text_column not in schema.names:
                raise ValueError(f"{path} has no column {text_column!r} (columns: {schema.names}); "
                                 f"pass --text-column")
            column_type = str(schema.field(text_column).type)
            if "string" not in column_type:
                raise ValueError(f"{path}: column {text_column!r} holds {column_type}, not text: pass "
                                 f"--text-column naming a text column")
    most = sum(p.stat().st_size + 1 for p in files)
    if kind != "hub" and most < window:
        raise ValueError(f"{source} holds at most {most} tokens, fewer than seq_len+1={window}: pass more "
                         f"text or a smaller --seq-len")
    return kind, files


def _peek_json(files, text_column: str):
    """The first record of JSON-lines files: a JSON object whose `text_column` is a string."""
    for path in files:
        if path.suffix == ".json":   # a JSON array or object of columns: only datasets reads it whole
            return
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path} line {number} is not JSON ({error}): fix the file or pass "
                                     f"another --dataset") from None
                if not isinstance(record, dict) or text_column not in record:
                    columns = sorted(record) if isinstance(record, dict) else []
                    raise ValueError(f"{path} has no column {text_column!r} (columns: {columns}); "
                                     f"pass --text-column")
                if not isinstance(record[text_column], str):
                    held = type(record[text_column]).__name__
                    raise ValueError(f"{path}: column {text_column!r} holds {held}, not text: pass "
                                     f"--text-column naming a text column")
                return
    raise ValueError(f"{files[0] if len(files) == 1 else 'the folder'} holds no records: pass a file with "
                     f"one JSON object per line")
