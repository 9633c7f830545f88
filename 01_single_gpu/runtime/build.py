"""What every trainer builds before its first step: the device, the data, the seeded model (plumbing).

Every folder starts from the same model: 01's Llama built on the meta device, with the --kernels/--attn
pieces swapped in (kernels/patch.py) and, with --compile, each decoder layer marked for torch.compile;
each folder slices it from outside and then materialises only what the rank keeps (materialize.py: each
parameter seeded by (--seed, its name), or read from --init-from), so a parallel layout reproduces 01's
numbers from the first step without ever holding the whole model. Mixed precision (playbook §2.1,
mixed_precision.py): --dtype bfloat16/float16 run forward and backward under autocast, over fp32 weights
or (--precision-layout bf16-16/bf16-20) bf16 ones; float32 and float64 run everything in that type.
"""
import math
import os
import resource
from pathlib import Path

import torch

import materialize as materialize_mod
import model as modeling
import mixed_precision

def device_of(args):
    if args.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def free_bytes(args) -> tuple:
    """(bytes, what they are) this rank may allocate: its GPU's free memory (torch.cuda.mem_get_info); on
    the CPU, the host's available RAM, which its ranks share (LOCAL_WORLD_SIZE), or less where its cgroup's
    memory.max or the process's limits (`ulimit -v`: RLIMIT_AS, `ulimit -d`: RLIMIT_DATA) leave less."""
    if args.device == "cuda":
        index = device_of(args).index
        with torch.cuda.device(index):
            return torch.cuda.mem_get_info()[0], f"GPU {index} has free"
    share = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    host = ((_available_ram(), "the host has available"), (_cgroup_room(), "its cgroup allows"))
    rooms = [(room // share, f"{words} for each of its {share} ranks" if share > 1 else words)
             for room, words in host if room is not None]
    limits = (("ulimit -v", resource.RLIMIT_AS, "VmSize"), ("ulimit -d", resource.RLIMIT_DATA, "VmData"))
    rooms += [(room, f"{ulimit} leaves") for ulimit, limit, held in limits
              for room in [_rlimit_room(limit, held)] if room is not None]
    return min(rooms, default=(math.inf, "nothing limits"))


def _available_ram():
    """MemAvailable (/proc/meminfo, Linux) in bytes, else None."""
    try:
        return int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return None


def _cgroup_room():
    """memory.max − memory.current of the process's cgroup (v2, a container's), else None."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        return None if limit == "max" else int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def _rlimit_room(limit, held_field: str):
    """A resource limit (RLIMIT_AS: `ulimit -v`; RLIMIT_DATA: `ulimit -d`) less what the process holds of it
    (/proc/self/status's VmSize, VmData), else None."""
    soft = resource.getrlimit(limit)[0]
    try:
        held = int(Path("/proc/self/status").read_text().split(f"{held_field}:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        held = 0
    return None if soft == resource.RLIM_INFINITY else soft - held


def param_dtype(args):
    """The weights' dtype: the layout's (mixed_precision.py): fp32 under autocast, bf16 for bf16-16/20."""
    return mixed_precision.layout_of(args).weights


def activation_element_bytes(args) -> int:
    """Bytes per activation element: 2 under bf16/fp16 autocast, else the parameters' dtype's."""
    if args.dtype in mixed_precision.AUTOCAST:
        return 2
    return torch.empty(0, dtype=param_dtype(args)).element_size()


def build_model(args, config):
    """01's model on the meta device (shapes, no memory), with the --kernels/--attn pieces swapped in.
    Later folders slice it from outside; `materialize` then gives the rank's parameters their values."""
    with torch.device("meta"):
        model = modeling.LlamaForCausalLM(config)
    for name, p in model.named_parameters():
        p.global_name = name         # follows the parameter through every slicing: checkpoints are global
    if (args.kernels, args.attn) != ("torch", "sdpa"):
        from kernels import patch        # imported on demand: Triton loads only when asked for
        patch.apply_kernels(model, args.kernels, args.attn)
    if args.compile:
        compile_layers(model)
    return model


def compile_layers(model):
    """--compile: torch.compile each decoder layer, as torchtitan does, not the whole model.

    The L layers share one code and one compiled graph; the embedding, the loss and whatever a folder
    runs between layers (pipeline sends, gradient hooks) stay eager. `Module.compile` compiles in place
    and lazily: the state dict keeps its names, and the first call traces the layer as the folder left it
    (tensor-parallel shards, a context-parallel attention core, recompute's checkpoint, an MoE block)."""
    for layer in model.model.layers:
        layer.compile()


def source(model, args):
    """Where the meta parameters of `model` get their values (materialize.py): --init-from or the seed."""
    return materialize_mod.Source(model, materialize_mod.Initializer(args.seed, args.init_from),
                                  param_dtype(args), device_of(args))


def materialize(model, args, keep=None):
    """This rank's parameters of the meta `model` (all, or those in `keep`), on its device; returns model."""
    return materialize_mod.materialize(model, source(model, args), keep)
