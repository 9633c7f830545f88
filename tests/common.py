"""Shared test settings: a tiny Llama and short runs, so every comparison finishes in seconds."""
import sys
from datetime import timedelta
from importlib import import_module

# 4 layers (pp 4, or pp 2 × 2 chunks), 4 heads / 2 KV heads (tp 2), vocab 320 (tp 4), seq 32 (cp 4 zig-zag).
TINY = ["--hidden-size", "32", "--intermediate-size", "64", "--num-layers", "4", "--num-heads", "4",
        "--num-kv-heads", "2", "--seq-len", "32", "--lr", "3e-3", "--warmup-steps", "1", "--no-progress",
        "--log-every", "1000"]
SEQ_LEN = 32


def argv(*extra, steps=3, mbs=4, grad_acc=1, dtype="float32"):
    return TINY + ["--steps", str(steps), "--mbs", str(mbs), "--grad-acc", str(grad_acc), "--dtype", dtype,
                   *map(str, extra)]


def single_device_run(*extra, **kw):
    """(losses per step, final state dict) of 01_single_gpu for the same flags."""
    records, model = import_module("01_single_gpu.train").main(argv(*extra, **kw))
    return [r["loss"] for r in records], {k: v.detach().clone() for k, v in model.state_dict().items()}


def single_device_reference(*extra, **kw):
    """(losses, gradient norms, final state dict) of 01_single_gpu for the same flags. The norms matter:
    with the clip active, a gradient off by a constant factor leaves losses and parameters unchanged."""
    records, model = import_module("01_single_gpu.train").main(argv(*extra, **kw))
    return ([r["loss"] for r in records], [r["grad_norm"] for r in records],
            {k: v.detach().clone() for k, v in model.state_dict().items()})


def torchrun_environment(rank: int, world_size: int, port: int) -> dict:
    """What torchrun's agent gives worker `rank`: every rank a client of the store the launcher serves on
    `port` (launcher_store), so no rank has to bind a port another process could have taken first."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                TORCHELASTIC_USE_AGENT_STORE="True")


def launcher_store(world_size: int, timeout_s: float = 300.0):
    """The TCPStore a launcher serves for its ranks, as torchrun's agent does: on a port the system gives
    it (`.port`) and it keeps until the store is dropped. Make it after forking: a forked child would hold
    a server whose thread it lacks."""
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def exit_launcher(groups) -> list:
    """The command of tests/exit_launcher.py for [(runs, ranks, script, argv)], one group after the other."""
    command = [sys.executable, "tests/exit_launcher.py"]
    for k, (runs, ranks, script, arguments) in enumerate(groups):
        command += ["--then"] * (k > 0) + [str(runs), str(ranks), script, *map(str, arguments)]
    return command
