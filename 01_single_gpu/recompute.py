"""Activation recomputation (gradient checkpointing), applied to the model from outside.

Playbook §2.1 (activation recomputation) and Korthikanti et al. (the playbook's ref. [9]): instead of
keeping every intermediate activation for the backward pass, keep less and recompute the rest.

    none       keep everything:                       ≈ s·b·h·(34 + 5·a·s/h) bytes per layer (16-bit)
    selective  recompute only the attention core      ≈ 34·s·b·h bytes per layer: the s² scores go,
               (softmax(qkᵀ)v), cheap to redo but       for ~3% more compute (GPT-3: −70% memory)
               quadratic in s to store
    full       keep only each layer's input            ≈ 2·s·b·h bytes per layer, for ~30-40% more
                                                        compute (one extra forward)
MFU does not count the recomputed FLOPs; HFU does (metrics.py). `tests/test_single_gpu.py` checks that all
three give identical gradients and that the saved activations shrink in this order.

    python 01_single_gpu/train.py --recompute selective --steps 3   # the measured peak after step 1
"""
import functools

from torch.utils.checkpoint import checkpoint

RECOMPUTE_MODES = ("none", "selective", "full")


def checkpointed(fn):
    """fn, but its intermediate activations are recomputed in backward instead of being stored."""
    @functools.wraps(fn)
    def run(*args):
        # exercise 01.4: activation recomputation
        # hint: [PB] §2.1 "Activation recomputation": torch.utils.checkpoint keeps a function's inputs and
        #   runs it again in backward (the non-reentrant form); full wraps what a whole layer computes,
        #   selective only the part whose activations grow with s² (the module docstring's table).
        # test: tests/test_single_gpu.py::test_recompute_modes_give_identical_gradients_and_save_less
        return checkpoint(fn, *args, use_reentrant=False)
        # end exercise
    return run


def apply_recompute(model, mode: str):
    """Wrap each decoder layer (full) or each attention core (selective) of a LlamaForCausalLM."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"--recompute {mode!r}: choose one of {RECOMPUTE_MODES}")
    for layer in model.model.layers:
        if mode == "full":
            # exercise 01.4
            layer.forward = checkpointed(layer.forward)
            # end exercise
        elif mode == "selective":
            # exercise 01.4
            layer.self_attn.attn_fn = checkpointed(layer.self_attn.attn_fn)
            # end exercise
    return model
