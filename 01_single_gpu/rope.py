"""Rotary position embeddings (RoPE), with the scalings Llama checkpoints use.

RoFormer (Su et al. 2021); playbook §2.1 (the model). Query and key vectors are turned by angles that grow
with the position: the pair (x_i, x_{i+hd/2}) of position m, read as the complex number x_i + i·x_{i+hd/2},
is multiplied by e^{i·m·ω_i} with ω_i = theta^(-2i/hd), so q·k depends on positions only through their
difference. Llama's scalings stretch the context: `linear` (position interpolation) and Llama 3.1's
`llama3` (wavelength bands), as Hugging Face computes them (`rope_inv_freq`). model.py's attention calls
`apply_rotary` as its swappable `Attention.rope_fn` (kernels/rope.py: one Triton launch).

    python 01_single_gpu/train.py --steps 200

Shape legend (model.py): B batch, T sequence, nh query heads, nkv key/value heads, hd head dim.
"""
import math

import torch


# The RoPE scalings Llama checkpoints use (Llama 2 long-context variants, Llama 3.1/3.2), with the keys each
# reads, spelt as Hugging Face spells them; `rope_inv_freq` implements them.
ROPE_SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def check_rope_scaling(scaling: dict):
    """A clear error for a scaling `rope_inv_freq` does not implement, or one with missing/extra keys."""
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"RoPE scaling '{kind}' is not implemented (supported: default, linear, llama3)")
    keys = set(scaling) - {"rope_type"}
    if keys != set(ROPE_SCALINGS[kind]):
        raise ValueError(f"RoPE scaling '{kind}' takes exactly {', '.join(ROPE_SCALINGS[kind])}; "
                         f"got {', '.join(sorted(keys))}")
    if kind == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ValueError("llama3 RoPE scaling needs low_freq_factor < high_freq_factor")



def rope_inv_freq(config, device=None):
    """(hd/2,) float32 inverse frequencies ω_i = theta^(-2i/hd) (RoFormer, Su et al. 2021), then scaled.

    linear (Chen et al. 2023, position interpolation): ω_i / factor, positions squeezed by `factor`.
    llama3 (Llama 3.1's wavelength-banded scaling, `apply_scaling` of Meta's llama-models code): with the
    wavelength λ_i = 2π/ω_i and the pretraining context L = original_max_position_embeddings,
        λ_i < L/high_freq_factor    ω_i              short wavelengths (local order) are kept
        λ_i > L/low_freq_factor     ω_i / factor     long ones are interpolated
        otherwise                   (1 − s)·ω_i/factor + s·ω_i,  s = (L/λ_i − low)/(high − low)
    (low, high = low_freq_factor, high_freq_factor; s runs from 0 at λ = L/low to 1 at λ = L/high).
    All in float32, operation for operation as Hugging Face computes them: pretrained Llama weights were
    trained with exactly these rounded frequencies.
    """
    hd = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd)   # (hd/2,)
    scaling = config.rope_scaling or {"rope_type": "default"}
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq                                   # (hd/2,) tokens per turn
        s = (context / wavelength - low) / (high - low)                       # (hd/2,) blend weight
        blended = (1 - s) * inv_freq / factor + s * inv_freq
        scaled = torch.where(wavelength > context / low, inv_freq / factor, blended)
        return torch.where(wavelength < context / high, inv_freq, scaled)
    return inv_freq


def rotary_cos_sin(position_ids, config, dtype):
    """cos, sin of shape (T, hd) for the given positions (T,): angle_i = pos · ω_i, ω from `rope_inv_freq`.

    Takes the config, not theta, so every caller gets the scaled frequencies. The angles are computed
    in float32 whatever the model's dtype, as Hugging Face does.
    """
    # exercise 01.2: rotary position embedding
    # hint: RoFormer (Su et al. 2021) §3.2: position m turns pair i by the angle m·ω_i, the frequencies ω_i
    #   from `rope_inv_freq`, in float32 whatever the dtype; apply_rotary reads one angle per dimension,
    #   pairing dimension i with i + hd/2.
    # test: tests/test_single_gpu.py::test_rotary_embedding_turns_each_pair_by_position_times_frequency
    inv_freq = rope_inv_freq(config, position_ids.device)                # (hd/2,)
    angles = position_ids.float()[:, None] * inv_freq[None, :]            # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)                          # (T, hd)
    return angles.cos().to(dtype), angles.sin().to(dtype)
    # end exercise


def rotate_half(x):  # (..., hd) -> (..., hd): [x1, x2] -> [-x2, x1]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(q, k, cos, sin):
    """Rotate q (B, nh, T, hd) and k (B, nkv, T, hd) by the angles in cos/sin (T, hd), in q's and k's dtype.

    fp32 angles under bf16 autocast: the products run in fp32 and are rounded once, to the bf16 the
    attention reads (the values it read before, when it cast fp32 q and k itself)."""
    return (q * cos + rotate_half(q) * sin).to(q.dtype), (k * cos + rotate_half(k) * sin).to(k.dtype)
