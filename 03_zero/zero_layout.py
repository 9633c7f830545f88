"""03's flags, the layouts it refuses, and the ZeRO and ZeRO-Offload papers' bytes per rank.

Playbook §2.2 "ZeRO"; Rajbhandari et al. §5 (the split of the model states), Ren et al. §4 (offload).
Shared by 03's train.py and the tests, which check the bytes zero.py and offload.py really hold against
these numbers. Per rank, Ψ padded elements of e bytes, N ranks, AdamW's 2 states:

    stage 1   parameters eΨ      gradients eΨ      optimizer states 2eΨ/N     `expected_state_bytes`
    stage 2   parameters eΨ      gradients eΨ/N    optimizer states 2eΨ/N
    stage 3   parameters eΨ/N    gradients eΨ/N    optimizer states 2eΨ/N
    offload   optimizer: the device keeps the stage's parameters and gradients, no optimizer state; the
              host the master eΨ/N, its gradient eΨ/N and the states 2eΨ/N   `expected_offload_bytes`
              param (ZeRO-3): nothing between steps (`expected_peak_device_bytes` during one); the host
              stage 3's three numbers

`check_zero` and `check_offload` raise every rule's error before any process group exists.

    torchrun --nproc_per_node 2 03_zero/train.py --dp 2 --zero-stage 2 --offload optimizer
New compared with 02: --zero-stage and --offload; `print_memory` sets the measured bytes beside them.
"""
import build
import memory


def add_arguments(parser):
    """--zero-stage and --offload."""
    g = parser.add_argument_group("ZeRO and ZeRO-Offload (03)")
    g.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=1,
                   help="1: optimizer states, 2: + gradients, 3: + parameters sharded over the dp ranks")
    g.add_argument("--offload", choices=["none", "optimizer", "param"], default="none",
                   help="optimizer: AdamW's states and the master shard in host memory, the step on the CPU; "
                        "param (ZeRO-3): the parameter shards too, copied to the device for each all-gather")
    return g


# ======================================================================================
# ZeRO-1/2/3 (zero.py)
# ======================================================================================
def check_zero(args):
    """What ZeRO-3 cannot do here, refused before any process group exists."""
    if args.zero_stage != 3:
        return
    if args.tie_embeddings:
        raise ValueError("--zero-stage 3 gathers each module's own parameters: drop --tie-embeddings "
                         "(a tying preset: pass --no-tie-embeddings) "
                         "or use --zero-stage 1 or 2")
    if args.kernels != "torch":
        raise ValueError("--zero-stage 3 gathers the head in lm_head's forward hook, which the fused "
                         "loss of --kernels triton bypasses: use --kernels torch")


def expected_state_bytes(stage, n, padded_bytes, layout=None, numel=0):
    """The ZeRO paper's split (params, grads, optimizer) for AdamW (2 states) in the parameters' dtype, or
    for 01's mixed-precision `layout`: Ψ padded elements of w/g bytes, g reduced in the accumulation dtype
    a (bf16-20: 4; stage 1 also keeps the `numel` parameters' bf16 .grad), fp32 master and AdamW over N."""
    if layout is None or layout.master is None:
        psi = padded_bytes
        return (psi // n if stage >= 3 else psi, psi // n if stage >= 2 else psi, 2 * psi // n)
    w, g, o = layout.bytes_per_parameter()
    psi = padded_bytes // w                                           # elements
    a = g - w if layout.accumulation else w                           # bytes of the reduced gradient buffer
    grads = (a * psi + (w * numel if layout.accumulation else 0)) if stage == 1 else a * psi // n
    return (w * psi // n if stage >= 3 else w * psi, grads, o * psi // n)


# ======================================================================================
# ZeRO-Offload (offload.py)
# ======================================================================================
def check_offload(args):
    """What offloading cannot do here, refused before any process group exists."""
    if args.offload == "none":
        return
    if args.offload == "param" and args.zero_stage != 3:
        raise ValueError(f"--offload param moves ZeRO-3's parameter shards to the host: add --zero-stage 3 "
                         f"(not {args.zero_stage}), or use --offload optimizer")


def expected_offload_bytes(offload, stage, n, padded_bytes, layout=None, numel=0):
    """ZeRO-Offload's split of the ZeRO paper's numbers (expected_state_bytes), AdamW's 2 states:
    (device parameters, gradients, optimizer states), (host master, gradients, optimizer states).
    A bf16 `layout`: the device keeps what the layout's ZeRO-s keeps but the optimizer's 12Ψ/N; the host
    the fp32 master 4Ψ/N, its fp32 gradient 4Ψ/N and AdamW's 8Ψ/N (Ψ elements).
    "param" (ZeRO-3): the device keeps nothing between steps, the host what ZeRO-3 keeps on the device
    (the layout's: bf16-16 2Ψ/N, 2Ψ/N, 12Ψ/N; bf16-20 2Ψ/N, 4Ψ/N, 12Ψ/N, the masters with the states)."""
    params, grads, states = expected_state_bytes(stage, n, padded_bytes, layout, numel)
    if offload == "param":
        return (0, 0, 0), (params, grads, states)
    device = (params, grads, 0)
    if layout is None or layout.master is None:
        master = padded_bytes // n
    else:                                     # weights' bytes w, master m: optimizer bytes 3m per element
        w, _, optimizer = layout.bytes_per_parameter()
        master = padded_bytes // w * (optimizer // 3) // n
    return device, (master, master, 2 * master)


def expected_peak_device_bytes(units):
    """--offload param: the most the device holds of the model during a step, e·max over neighbouring
    units k, k+1 of (U_k + U_k+1 + max(U_k, U_k+1)/N): the unit running and the one prefetched (forward:
    k+1, backward: k), gathered, and the prefetched one's shard copy, until its all-gather has read it."""
    full = [u.padded * u.full.element_size() for u in units]
    n = units[0].padded // (units[0].hi - units[0].lo)
    return max(a + b + max(a, b) // n for a, b in zip(full, full[1:]))


def print_memory(zero, offload, model, optimizer, args, config, dp_size, precision):
    """Rank 0 after training: the model states this rank holds, measured, beside the papers' numbers (and
    with --offload, what the host holds; with --offload param, the device's peak and copies in a step)."""
    host_side = offload or (zero if args.offload == "param" else None)     # what holds the host's bytes
    params, grads, states = zero.model_state_bytes(model, optimizer)
    activations = memory.activation_bytes_estimate(config, args.mbs, args.seq_len,
                                                   build.activation_element_bytes(args), args.recompute)
    report = memory.MemoryReport(params, grads, states, activations, numel=zero.padded_numel,
                                 layout=precision.name)
    where = ", on the device" if host_side else ""
    print(report.table(f"memory per rank, measured (ZeRO-{args.zero_stage}, dp {dp_size}{where}; "
                       f"fp32 masters in optimizer states, fp32 accumulation in gradients)"))
    numel = sum(p.numel() for p in model.parameters())
    expected = expected_state_bytes(args.zero_stage, dp_size, zero.padded_bytes, precision, numel)
    # ZeRO-Offload's split: the optimizer (param: the shards too) on the host
    if host_side:
        expected, host = expected_offload_bytes(args.offload, args.zero_stage, dp_size, zero.padded_bytes,
                                                precision, numel)
    print("  ZeRO paper:                  " + mib_line(expected))
    if host_side:
        print("  host (offloaded), measured:  " + mib_line(host_side.host_bytes(optimizer)))
        print("  ZeRO-Offload paper, host:    " + mib_line(host))
    if args.offload == "param":
        formula = expected_peak_device_bytes(zero.units)
        print(f"  device, during the step:     {zero.peak_device_bytes / 2**20:.2f} MiB at most "
              f"(gathered units and shard copies, measured), {formula / 2**20:.2f} MiB by the formula")
        print(f"  copies in the last step:     {zero.h2d_bytes / 2**20:.2f} MiB host -> device, "
              f"{zero.d2h_bytes / 2**20:.2f} MiB back (2A·eΨ/N and A·eΨ/N)")


def mib_line(state_bytes) -> str:
    return ", ".join(f"{name} {v / 2**20:.2f} MiB" for name, v in
                     zip(("parameters", "gradients", "optimizer states"), state_bytes))
