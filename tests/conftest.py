import importlib.util
import os
import sys
from importlib import import_module
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # tests/harness.py, tests/common.py
if not torch.cuda.is_available():
    # Triton reads it when kernels/ is first imported, by whichever test module comes first (test_fp8
    # imports kernels/ before test_kernels would set it); spawned ranks inherit it
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session", autouse=True)
def data_cache():
    """Tokenize and pack the default corpus once, before any ranks are spawned to read it. Building it
    needs `datasets`, which the lent GPU machines lack: there only the tests that read it fail."""
    if importlib.util.find_spec("datasets") is None:
        return
    import common
    data = import_module("01_single_gpu.data")
    data.build_dataset("stdlib", data.ByteTokenizer(), common.SEQ_LEN)


@pytest.fixture(scope="session")
def default_reference():
    """01's (losses, gradient norms, final state dict) for common.argv()'s defaults (3 steps, mbs 4): the
    reference of every whole TP and CP run that keeps the default global batch, computed once."""
    import common
    return common.single_device_reference()
