"""01_single_gpu/runtime/data.py: what the cache is keyed on, which sources load, and what building costs.

Compared here: token windows against the tokens the source must give (exact integers, so no
tolerance), the cache against a rebuild after each input that changes the tokens (text column,
tokenizer content), and the peak memory of a build against a bound. Everything runs offline: the
HF tokenizers are built here with the `tokenizers` package and saved to a temporary directory.
"""
import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import common

import data
import sources

ROOT = Path(__file__).resolve().parents[1]


def stream(windows) -> list:
    """All windows' tokens, in order, as one list."""
    return [int(t) for i in range(len(windows)) for t in windows[i]["input_ids"]]


def expected_stream(docs, tok, seq_len) -> list:
    """Each document's tokens closed by EOS, concatenated and cut to whole windows of seq_len+1."""
    ids = [t for d in docs for t in tok.encode(d) + [tok.eos_token_id]]
    return ids[: len(ids) // (seq_len + 1) * (seq_len + 1)]


def save_word_tokenizer(path, words):
    """A WordLevel HF tokenizer (ids in the order of `words`, "<eos>" first) saved to `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    ids = {w: i for i, w in enumerate(["<eos>", "<unk>"] + words)}
    core = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>").save_pretrained(path)


def test_text_columns_of_one_jsonl_are_cached_apart(tmp_path):
    """Two text columns of one .jsonl file give each column's own tokens from one cache directory
    (the column is part of the cache key), and rewriting the file in place gives the new text."""
    rows = [{"question": f"why {i}? " * 8, "answer": f"because {i}. " * 8} for i in range(6)]
    (tmp_path / "qa.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tok, cache = data.ByteTokenizer(), tmp_path / "cache"
    for column in ("question", "answer"):
        windows = data.build_dataset(str(tmp_path / "qa.jsonl"), tok, 15, cache, text_column=column)
        assert stream(windows) == expected_stream([r[column] for r in rows], tok, 15), column
    (tmp_path / "qa.jsonl").write_text("\n".join(json.dumps({"answer": f"no {i}. " * 9}) for i in range(6)))
    windows = data.build_dataset(str(tmp_path / "qa.jsonl"), tok, 15, cache, text_column="answer")
    assert stream(windows) == expected_stream([f"no {i}. " * 9 for i in range(6)], tok, 15)


def test_folder_of_jsonl_files_loads_with_text_column(tmp_path):
    """A folder of .jsonl files (one nested) is read in sorted path order, one document per record:
    the windows are exactly the records' bytes, each closed by EOS."""
    (tmp_path / "docs" / "more").mkdir(parents=True)
    docs = [f"document {i}: " + "lorem ipsum " * (5 + i) for i in range(9)]
    for name, part in (("a.jsonl", docs[:4]), ("more/b.jsonl", docs[4:])):
        (tmp_path / "docs" / name).write_text("\n".join(json.dumps({"body": d, "id": k})
                                                         for k, d in enumerate(part)))
    tok = data.ByteTokenizer()
    windows = data.build_dataset(str(tmp_path / "docs"), tok, 31, tmp_path / "cache", text_column="body")
    assert stream(windows) == expected_stream(docs, tok, 31)
    assert tok.decode(windows[0]["input_ids"]).startswith("document 0: lorem")


def test_folders_without_a_supported_kind_name_the_fix(tmp_path):
    """A folder with no supported files, text files mixed with record files, or a local path that does
    not exist (rather than a hub lookup) is refused in one line that names the fix."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match=r"no \.txt/\.md/\.py or \.jsonl/\.json/\.parquet files there; pass"):
        data.build_dataset(str(tmp_path / "empty"), data.ByteTokenizer(), 7, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="does not exist: pass --dataset an existing file or folder"):
        data.build_dataset(str(tmp_path / "missing.jsonl"), data.ByteTokenizer(), 7, tmp_path / "cache")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "notes.txt").write_text("plain text")
    (tmp_path / "mixed" / "rows.jsonl").write_text(json.dumps({"text": "a record"}))
    with pytest.raises(ValueError, match="mixes text files .* with JSON records .*: split them into two"):
        data.build_dataset(str(tmp_path / "mixed"), data.ByteTokenizer(), 7, cache_dir=tmp_path / "cache")


def test_text_files_are_cut_into_pieces_and_tokenized_by_several_processes(tmp_path, monkeypatch, capfd):
    """Text files longer than a piece (one of them a single line longer than a piece), tokenized by two
    processes: the windows are exactly each file's bytes with one EOS at its end, as in one call."""
    monkeypatch.setattr(data, "TEXT_BYTES_PER_PROC", 2**16)   # ~400 KB of text: as many processes as cores
    (tmp_path / "docs").mkdir()
    docs = ["short line\n" * 15_000, "x" * (2 * data.PIECE_CHARS + 123), "é and ü\n\n" * 9_000]
    for i, d in enumerate(docs):
        (tmp_path / "docs" / f"{i}.txt").write_text(d, encoding="utf-8")
    tok = data.ByteTokenizer()
    windows = data.build_dataset(str(tmp_path / "docs"), tok, 63, cache_dir=tmp_path / "cache")
    assert stream(windows) == expected_stream(docs, tok, 63)
    assert len(os.sched_getaffinity(0)) < 2 or "num_proc=2" in capfd.readouterr().err


def test_concurrent_builders_build_once(tmp_path, monkeypatch):
    """Two threads ask for the same cache at once: one builds (made slow here) while the other waits
    on the lock, then both read the same windows. Builds are counted by wrapping `_build`."""
    (tmp_path / "a.txt").write_text("some text\n" * 2000)
    builds, build = [], data._build

    def slow_build(*args):
        builds.append(args)
        time.sleep(1.0)
        build(*args)
    monkeypatch.setattr(data, "_build", slow_build)
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: data.build_dataset(str(tmp_path / "a.txt"), data.ByteTokenizer(), 15,
                                                          tmp_path / "cache"), range(2)))
    assert len(builds) == 1 and np.array_equal(both[0].windows, both[1].windows)
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".lock", ".npy"]   # scratch removed


def test_tokenizer_content_is_part_of_the_cache_key(tmp_path):
    """A different vocabulary saved under the same tokenizer directory gives its own ids, not the
    windows cached for the first vocabulary (the key hashes the tokenizer's content, not its name)."""
    words = [f"w{i}" for i in range(20)]
    (tmp_path / "doc.txt").write_text(" ".join(words * 10))
    for vocabulary in (words, words[::-1]):
        save_word_tokenizer(tmp_path / "tok", vocabulary)
        tok = data.load_tokenizer(str(tmp_path / "tok"))
        windows = data.build_dataset(str(tmp_path / "doc.txt"), tok, 7, cache_dir=tmp_path / "cache")
        assert list(windows[0]["input_ids"]) == [2 + vocabulary.index(f"w{i}") for i in range(8)]
        assert tok.decode(windows[0]["input_ids"]) == " ".join(words[:8])


def test_cache_key_names_each_file_by_its_resolved_path(tmp_path):
    """The key's paths are each file's Path.resolve() (folders are resolved once, not per file): through a
    linked folder, a linked file and a relative path alike, so a cache is found again however the same
    files are named. The default corpus keys the same way and is listed once per process."""
    (tmp_path / "real").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "real" / name).write_text(name * 40)
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "c.txt").symlink_to(tmp_path / "real" / "a.txt")
    files = [tmp_path / "linked" / "a.txt", tmp_path / "real" / "b.txt", tmp_path / "real" / "c.txt",
             Path(os.path.relpath(tmp_path / "real" / "b.txt"))]
    stdlib = sources.default_corpus_files()
    assert sources.default_corpus_files() is stdlib and len(stdlib) > 100
    for paths in (files, stdlib):
        assert [(str(path), *stat) for path, stat in data._resolved_stats(paths)] == \
            [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]
    assert [path.name for path, _ in data._resolved_stats(files)] == ["a.txt", "b.txt", "a.txt", "b.txt"]


def test_default_corpus_windows_are_unchanged():
    """The default cache (stdlib sources, byte tokenizer, built by conftest) holds exactly the windows
    every reference loss was measured on: each file's UTF-8 bytes (read as text, so line ends are
    normalised) closed by EOS=256, concatenated in sorted file order and cut into seq_len+1 windows."""
    tok = data.ByteTokenizer()
    windows = data.build_dataset("stdlib", tok, common.SEQ_LEN)
    docs = [p.read_text(encoding="utf-8", errors="replace") for p in sources.default_corpus_files()]
    ids = np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8).astype(np.int64), tok.eos_token_id)
                          for d in docs])
    n = len(ids) // (common.SEQ_LEN + 1)
    reference = ids[: n * (common.SEQ_LEN + 1)].reshape(n, common.SEQ_LEN + 1)
    assert len(windows) == n
    got = np.stack([windows[i]["input_ids"] for i in range(n)])
    assert got.dtype == np.int64 and np.array_equal(got, reference)


BUILD_IN_A_CHILD = textwrap.dedent("""
    import json, resource, sys
    from importlib import import_module
    sys.path.insert(0, sys.argv[1])
    import data
    import datasets  # imported before the baseline: the bound is on the build, not on the imports
    tok = data.load_tokenizer(sys.argv[2])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    windows = data.build_dataset(sys.argv[3], tok, 255, cache_dir=sys.argv[4])
    peak = max(resource.getrusage(who).ru_maxrss  # the build's own process and its tokenizing workers
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    print(json.dumps({"before_kib": before, "peak_kib": peak, "windows": len(windows),
                      "first": tok.decode(windows[0]["input_ids"])}))
""")


def test_bpe_build_of_a_large_text_file_has_bounded_memory(tmp_path):
    """A 5 MiB text file (one document, 1.1M tokens) through a byte-level BPE tokenizer, built in a fresh
    process: its peak resident memory may grow by at most 200 MiB over what the imports take. Tokenizing
    the whole file in one call and packing through Python lists grew it by 580-870 MiB over several runs
    (2-core CPU sandbox); cut into line-aligned pieces and packed with numpy it grew by ~55 MiB, most of it
    the arrow and .npy pages it maps. The windows must still decode to the start of the text
    (byte-level BPE round-trips exactly)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    rng = np.random.default_rng(0)
    vocabulary = np.array(["the", "data", "parallel", "rank", "tensor", "pipeline", "shard", "loss", "step",
                           "gradient", "all-reduce", "bubble", "micro-batch", "expert", "router", "token"])
    lines = [" ".join(vocabulary[rng.integers(0, len(vocabulary), rng.integers(4, 16))]) + "."
             for _ in range(80_000)]
    text = "\n".join(lines) + "\n"
    (tmp_path / "big.txt").write_text(text)
    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    core.train_from_iterator(lines[:2000], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>").save_pretrained(tmp_path / "tok")
    assert len(text) > 5 * 2**20
    out = subprocess.run([sys.executable, "-c", BUILD_IN_A_CHILD, str(ROOT / "01_single_gpu" / "runtime"),
                          str(tmp_path / "tok"), str(tmp_path / "big.txt"), str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    grown_mib = (report["peak_kib"] - report["before_kib"]) / 1024
    assert grown_mib < 200, f"building grew the peak RSS by {grown_mib:.0f} MiB"
    assert report["windows"] > 1000 and text.startswith(report["first"])
