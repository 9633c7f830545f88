"""01_single_gpu/runtime/checkpoint.py: checkpoints that cannot lie, and resumes that continue the same run.

Compared here: the manifest against the files on disk (sizes and sha256, exact); a resume past a corrupt
or torn newest checkpoint against the uninterrupted run (losses and weights bitwise: the fallback
checkpoint holds the exact state of its step, and the rest of the run is deterministic on the CPU); what
a folder holds after --overwrite, --keep-last and a failed publication; --json-log after a resume against
the steps that ran; a resume across folders (01 -> 02 at dp 1) against 01's own run (bitwise: dp 1 adds
no arithmetic). float32 on the CPU throughout.
"""
import hashlib
import json
import os
import re
from importlib import import_module
from pathlib import Path

import pytest
import torch

import common

import checkpoint
import model as modeling

ROOT = Path(__file__).resolve().parents[1]


def run_01(*extra, capsys=None, **kw):
    """01's losses and final state for common.argv(*extra); with `capsys`, also (exit status, stdout, stderr)
    of a run that exits (SystemExit)."""
    if capsys is None:
        return common.single_device_run(*extra, **kw)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        common.single_device_run(*extra, **kw)
    out = capsys.readouterr()
    return stop.value.code, out.out, out.err


def tensor_span(path, prefix="value/"):
    """(start, end) byte offsets in a safetensors file of its largest tensor whose name starts with
    `prefix`."""
    data = Path(path).read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    name = max((k for k in header if k.startswith(prefix)), key=lambda k: header[k]["data_offsets"][1]
               - header[k]["data_offsets"][0])
    begin, end = header[name]["data_offsets"]
    return 8 + length + begin, 8 + length + end


def corrupt(path):
    """4 KB of a model weight overwritten with 0xFF bytes (float32 NaN): the file still parses."""
    data = bytearray(Path(path).read_bytes())
    start, _ = tensor_span(path)
    data[start:start + 4096] = b"\xff" * 4096
    Path(path).write_bytes(bytes(data))


def truncate(path):
    Path(path).write_bytes(Path(path).read_bytes()[:-4096])


def test_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    """Each step folder holds the rank's tensor file and a manifest (written last, into the published
    folder) with the step, layout, global batch, arguments, run id, and every file's size and sha256."""
    ckpt = tmp_path / "c"
    run_01("--checkpoint-dir", ckpt, "--checkpoint-every", 1, steps=2)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000001", "step_000002"]   # no scratch left
    for step in (1, 2):
        folder = ckpt / f"step_{step:06d}"
        manifest = json.loads((folder / "manifest.json").read_text())
        file = folder / "rank_00000.safetensors"
        assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "rank_00000.safetensors"]
        assert manifest["files"] == {file.name: {"bytes": file.stat().st_size,
                                                 "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}}
        assert (manifest["step"], manifest["world_size"], manifest["layout"]) == (step, 1, {})
        assert manifest["global_batch"] == 4
        assert manifest["run_id"] == manifest["args"]["run_id"] and len(manifest["run_id"]) == 12


@pytest.mark.parametrize("damage, problem", [
    (corrupt, r"rank_00000\.safetensors fails its sha256 check"),
    (truncate, r"rank_00000\.safetensors has (\d+) bytes, the manifest says (\d+)"),
], ids=["corrupt", "truncated"])
def test_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path, capsys, damage, problem):
    """A newest checkpoint with 4 KB of its weights overwritten (or its tail cut off) is skipped with a
    warning naming the file; the run resumes from the one before and reproduces the uninterrupted run
    exactly, after saying which checkpoint and step it continues from. (Before manifests the corrupt file
    loaded silently: NaN weights, exit status 0.)"""
    full, full_state = run_01(steps=6)
    ckpt = tmp_path / "c"
    run_01("--checkpoint-dir", ckpt, "--checkpoint-every", 3, steps=6)
    damage(ckpt / "step_000006" / "rank_00000.safetensors")
    capsys.readouterr()
    resumed, state = run_01("--checkpoint-dir", ckpt, "--resume", steps=6)
    out, err = capsys.readouterr()
    assert re.search(r"step_000006 is unusable \(" + problem, err) and "resuming from step 3" in err, err
    assert f"resumed from {ckpt}/step_000003: step 3 done, training steps 4-6" in out, out
    assert resumed == full[3:]
    for name in full_state:
        assert torch.equal(state[name], full_state[name]), name
    assert checkpoint.verify(ckpt / "step_000006")[0] is None   # re-saved whole by the resumed run


def test_no_usable_checkpoint_refuses_naming_each(tmp_path, capsys):
    ckpt = tmp_path / "c"
    run_01("--checkpoint-dir", ckpt, "--checkpoint-every", 1, steps=2)
    corrupt(ckpt / "step_000002" / "rank_00000.safetensors")
    truncate(ckpt / "step_000001" / "rank_00000.safetensors")
    code, _, err = run_01("--checkpoint-dir", ckpt, "--resume", steps=4, capsys=capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert ("step_000002: rank_00000.safetensors fails its sha256 check" in err
            and "step_000001: rank_00000" in err)


def test_a_new_run_refuses_another_runs_folder_unless_overwrite(tmp_path, capsys):
    """Without --resume, a folder holding checkpoints is refused (a later --resume would continue the
    other run). With --overwrite the new run starts, and once it has published its first checkpoint the
    other run's are gone, so --resume continues the new run."""
    ckpt = tmp_path / "c"
    run_01("--checkpoint-dir", ckpt, steps=3)
    code, _, err = run_01("--checkpoint-dir", ckpt, "--seed", 7, steps=2, capsys=capsys)
    assert code == 2 and "holds another run's checkpoints (steps 3): pass --resume to continue it" in err, err
    new, _ = run_01("--checkpoint-dir", ckpt, "--overwrite", "--seed", 7, steps=2)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000002"]
    whole, _ = run_01("--seed", 7, "--lr-decay-steps", 2, steps=3)
    resumed, _ = run_01("--checkpoint-dir", ckpt, "--resume", "--seed", 7, steps=3)
    assert new == whole[:2] and resumed == whole[2:]


def test_resaving_a_step_keeps_the_old_copy_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    """Saving step 2 again where step 2 exists, with the process dying as the new copy is moved into place
    (the rename fails): the old copy is still on disk, byte for byte (under step_000002.old). The old code
    removed it first."""
    model = modeling.LlamaForCausalLM(modeling.LlamaConfig(vocab_size=64, hidden_size=16,
                                                           intermediate_size=32, num_hidden_layers=1,
                                                           num_attention_heads=2, num_key_value_heads=2))
    for name, p in model.named_parameters():
        p.global_name = name          # what 01's build.build_model gives every parameter
    optimizer = torch.optim.AdamW(model.parameters())
    meta = {"layout": {}, "global_batch": 1, "args": {"run_id": "r"}}
    first = checkpoint.save_checkpoint(tmp_path, 2, model, optimizer, meta)
    old_bytes = (first / "rank_00000.safetensors").read_bytes()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    rename = os.rename

    def dies_while_publishing(src, dst):
        if str(src).endswith(".tmp"):
            raise OSError("the process died here")
        rename(src, dst)
    monkeypatch.setattr(checkpoint.os, "rename", dies_while_publishing)
    with pytest.raises(OSError, match="died here"):
        checkpoint.save_checkpoint(tmp_path, 2, model, optimizer, meta)
    copies = [p / "rank_00000.safetensors" for p in tmp_path.iterdir() if p.name.startswith("step_000002")]
    assert any(c.exists() and c.read_bytes() == old_bytes for c in copies), sorted(os.listdir(tmp_path))


def test_keep_last_keeps_the_newest_checkpoints(tmp_path):
    ckpt = tmp_path / "c"
    run_01("--checkpoint-dir", ckpt, "--checkpoint-every", 1, "--keep-last", 2, steps=5)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000004", "step_000005"]


def test_resume_at_the_last_step_has_nothing_to_do(tmp_path, capsys):
    """--resume where the checkpoint already reached --steps exits 0 with a message (01 here; 06 in a
    plain run, --pp 1 in a world of its own, where the old code crashed in its timeline report)."""
    ckpt = tmp_path / "c"
    run_01("--checkpoint-dir", ckpt, steps=2)
    code, out, err = run_01("--checkpoint-dir", ckpt, "--resume", steps=2, capsys=capsys)
    assert (code == 0 and "nothing to do" in out and "holds step 2, and --steps is 2" in out
            and not err), (out, err)
    pipeline = import_module("06_pipeline.train")
    pp = common.argv("--checkpoint-dir", tmp_path / "p", "--pp", 1, steps=2)
    pipeline.main(pp)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        pipeline.main(pp + ["--resume"])
    out = capsys.readouterr()
    assert stop.value.code == 0 and "nothing to do" in out.out and not out.err, (out.out, out.err)


def test_json_log_on_resume_holds_each_step_once(tmp_path):
    """Run 5 steps logging every step, checkpoint at 3, then crash mid-way through a line; resuming from 3
    rewrites steps 4 and 5 instead of appending them again, and drops the torn line. The resume adds
    --profile: observing a run does not change it, so the flag is free (the old code refused it)."""
    ckpt, log = tmp_path / "c", tmp_path / "log.jsonl"
    full, _ = run_01("--checkpoint-dir", ckpt, "--checkpoint-every", 3, "--json-log", log, steps=5)
    import shutil
    shutil.rmtree(ckpt / "step_000005")            # the run "died" after logging step 5 ...
    with open(log, "a") as f:
        f.write('{"step": 6, "loss": 3.')           # ... in the middle of a line
    run_01("--checkpoint-dir", ckpt, "--resume", "--json-log", log, "--profile", tmp_path / "trace", steps=5)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in records] == full


def _run(folder, *extra):
    """A 6-step run of `folder`'s trainer, in this process (a world of one: its own process group)."""
    import_module(f"{folder}.train").main(common.argv(*extra, steps=6))


def test_cross_folder_resume(tmp_path):
    """01's checkpoint resumes in `02 --dp 1` (the same model and optimizer on a world of one): steps 4-6
    equal 01's own. A ZeRO-1 checkpoint of 03 (flat optimizer shards, saved as global pieces) resumes in 02
    too, with 01's losses (float32; only the order of a few sums differs: 1e-6 relative)."""
    full, _ = run_01(steps=6)
    ckpt, log = tmp_path / "c", tmp_path / "log.jsonl"
    run_01("--checkpoint-dir", ckpt, "--checkpoint-every", 3, steps=6)
    import shutil
    shutil.rmtree(ckpt / "step_000006")
    _run("02_data_parallel", "--dp", 1, "--checkpoint-dir", ckpt, "--resume", "--json-log", log)
    assert [json.loads(line)["loss"] for line in log.read_text().splitlines()] == full[3:]

    zero = tmp_path / "z"
    _run("03_zero", "--dp", 1, "--zero-stage", 1, "--checkpoint-dir", zero, "--checkpoint-every", 3)
    shutil.rmtree(zero / "step_000006")
    log = tmp_path / "zero.jsonl"
    _run("02_data_parallel", "--dp", 1, "--checkpoint-dir", zero, "--resume", "--json-log", log)
    assert ([json.loads(line)["loss"] for line in log.read_text().splitlines()]
            == pytest.approx(full[3:], rel=1e-6))
