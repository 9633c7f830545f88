"""On a CUDA GPU: every trainer's own path (NCCL process group, device placement, pinned host copies) at
world size 1, against 01 on the same GPU.

One GPU hosts one NCCL rank, so these runs check what a multi-GPU run adds to the CPU tests' gloo ranks
except the collectives' traffic: the backend choice, every tensor on the right device, and the offloads'
host <-> device copies (03's --offload param once reduce-scattered a host buffer, which NCCL refuses; the
CPU tests could not see it, all their tensors being host tensors). float32, TF32 off (PyTorch's default
for matmuls): the layouts reorder nothing at world size 1, so the losses agree to 1e-5 of the loss. 07's
model has experts, so 07 is compared with 07 on the CPU instead (to 1e-4: CPU and GPU kernels sum in
different orders). 03's offloads under bf16-20 and fp16 with --on-nonfinite skip are compared with 03
without offload. Skipped without a GPU; the CPU tests cover the same code on gloo ranks.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import argv

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(300)]

TRAINERS = {   # folder: its flags beyond the common ones
    "02_data_parallel": [],
    "03_zero": ["--zero-stage", "3", "--offload", "param"],
    "04_tensor_parallel": [],
    "05_sequence_context_parallel": [],
    "06_pipeline": ["--pp-schedule", "1f1b"],
    "08_5d_combined": ["--zero-stage", "1"],
}


def losses(folder, tmp_path, device, *extra):
    """The per-step losses of `folder/train.py` on `device`, each run a process of its own. Synthetic
    tokens: the lent GPU machines have no `datasets` to build the default corpus with."""
    log = tmp_path / f"{folder}-{device}.jsonl"
    launcher = [] if folder.startswith("01") else ["-m", "torch.distributed.run", "--nproc_per_node", "1"]
    command = [sys.executable, *launcher, str(ROOT / folder / "train.py"),
               *argv("--device", device, "--json-log", log, "--dataset", "synthetic", *extra, steps=3, mbs=2)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return losses("01_single_gpu", tmp_path_factory.mktemp("reference"), "cuda")


@pytest.mark.parametrize("folder", sorted(TRAINERS))
def test_trainer_on_cuda_matches_01(folder, reference, tmp_path):
    got = losses(folder, tmp_path, "cuda", *TRAINERS[folder])
    assert len(got) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference), atol=0, rtol=1e-5)


def test_expert_parallel_on_cuda_matches_cpu(tmp_path):
    on_gpu, on_cpu = (losses("07_expert_parallel", tmp_path, "cuda"),
                      losses("07_expert_parallel", tmp_path, "cpu"))
    torch.testing.assert_close(torch.tensor(on_gpu), torch.tensor(on_cpu), atol=0, rtol=1e-4)


OFFLOADED = {   # 03 with an offload against 03 without it, same precision: equal (the same arithmetic)
    "param-bf16-20-skip": (["--zero-stage", "3", "--dtype", "bfloat16", "--precision-layout", "bf16-20"],
                           ["--offload", "param", "--on-nonfinite", "skip"]),
    "optimizer-fp16-skip": (["--zero-stage", "2", "--dtype", "float16"],
                            ["--offload", "optimizer", "--on-nonfinite", "skip"]),
}


@pytest.mark.parametrize("name", sorted(OFFLOADED))
def test_offloads_on_cuda_equal_zero_without_them(name, tmp_path):
    """--offload param under bf16-20 and --offload optimizer under fp16 (loss scaling), both with
    --on-nonfinite skip, whose flag comes from host tensors and must reach NCCL on the device: the losses
    of the same ZeRO stage and precision without offload on the same GPU. Not bit for bit as on the CPU:
    offloaded, AdamW runs on the host's CPU, otherwise on the GPU, whose elementwise kernels may round
    apart in the last bit; 1e-4 of the loss bounds that over 3 steps (a missed sum or a stale shard moves
    the loss by 1e-3 or more: test_zero)."""
    common, offload = OFFLOADED[name]
    (tmp_path / "plain").mkdir(), (tmp_path / "offload").mkdir()
    plain = losses("03_zero", tmp_path / "plain", "cuda", *common)
    got = losses("03_zero", tmp_path / "offload", "cuda", *common, *offload)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(plain), atol=0, rtol=1e-4)
