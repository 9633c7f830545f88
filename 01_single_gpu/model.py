"""A Llama decoder, written once and transformed from outside by every later step.

Playbook §2.1 (the model whose memory and FLOPs every later chapter divides up). The architecture is
Llama's: RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU MLP, optional tied
embeddings. Parameter names and layouts are those of Hugging Face `LlamaForCausalLM`, so a
`config.json` + `model.safetensors` directory loads into it and back (`hf_io.py`): Llama 1, 2 and 3.x,
with their rope_theta and RoPE scaling (`linear`; Llama 3.1's `llama3`: rope.py). Other
scalings (yarn, dynamic, ...), biases and head_dim ≠ C/nh are refused by name.

Parameter count (playbook App. 5.2, GLU variant, untied head):
    N = 2·V·h + L·(2·h·h + 2·h·h_kv + 3·h·f + 2·h) + h
with h_kv = n_kv_heads·head_dim and f = intermediate size (h_kv = h and f = 8h/3 give ~16h² per layer).

Designed to be parallelised without being edited (01_single_gpu/README.md says who replaces what):
head counts come from the weight shapes; the attention core `Attention.attn_fn`, RoPE
`Attention.rope_fn`, the MLP `mlp` and its `act_fn`, and the loss `LlamaForCausalLM.loss_fn(hidden,
lm_head, labels)` are swappable attributes; an MLP may return (output, auxiliary loss), which every
layer returns and the model adds to the task loss.

    python 01_single_gpu/train.py --steps 200

Shape legend: B batch, T sequence, C hidden size, nh query heads, nkv key/value heads,
hd head dim, F intermediate size, V vocabulary.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import rope


@dataclass
class LlamaConfig:
    vocab_size: int = 320
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or Hugging Face's spelling:
    # {"rope_type": "linear" | "llama3", and that kind's rope.ROPE_SCALINGS keys}
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.rope_scaling is not None:
            rope.check_rope_scaling(self.rope_scaling)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"num_heads={self.num_attention_heads} does not divide "
                             f"hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_kv_heads={self.num_key_value_heads} does not divide "
                             f"num_heads={self.num_attention_heads} "
                             f"(grouped-query attention needs whole groups)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def to_compute_dtype(x):
    """x in the dtype the next matmul reads: autocast's (bf16/fp16) while autocast is on, else x as it is."""
    kind = x.device.type
    return x.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else x


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · w, computed in float32 as Hugging Face does; returned in the compute
    dtype (`to_compute_dtype`)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):  # (B, T, C)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Under autocast over fp32 weights, y would be fp32, and each linear reading it (q, k, v; gate, up)
        # would cast it to bf16 again: one cast here gives the same values, once.
        return to_compute_dtype(self.weight * x32.to(x.dtype))


def sdpa_attention(q, k, v):
    """Causal attention core: q (B, nh, T, hd), k/v (B, nkv, T, hd) -> (B, nh, T, hd).

    enable_gqa: query head h reads key/value head h // (nh/nkv) inside the kernel, without the copies
    `repeat_interleave` would make (nh/nkv times K and V, forward and backward). On CUDA only the
    FlashAttention backend takes it, in bf16/fp16: float32 would fall to the math backend, which holds the
    (B, nh, T, T) scores. There K and V are repeated instead, B·nh·T·hd each, for the memory-efficient one."""
    on_cuda_in = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
    if q.is_cuda and k.shape[1] != q.shape[1] and on_cuda_in not in (torch.bfloat16, torch.float16):
        return sdpa_repeated_kv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def sdpa_repeated_kv(q, k, v):
    """`sdpa_attention` with each key/value head copied for the nh/nkv query heads that read it."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)         # (B, nh, T, hd)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def eager_attention(q, k, v):
    """The same as `sdpa_attention`, written out: softmax(q kᵀ/√hd + causal mask) v."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)                                # (B, nh, T, hd)
    v = v.repeat_interleave(groups, dim=1)
    # exercise 01.1: causal self-attention
    # hint: softmax(q·kᵀ/√hd + M)·v ([PB] §2.1, "Attention is all you need" §3.2.1), where the causal mask M
    #   lets query i see keys 0…i only; take the softmax in float32 (01's README: mixed precision), the
    #   output in q's dtype. k and v already have one head per query head.
    # test: tests/test_single_gpu.py::test_eager_attention_is_causal_attention_over_shared_kv_heads
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])             # (B, nh, T, T)
    T = q.shape[2]
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype) @ v    # (B, nh, T, hd)
    # end exercise


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        c, hd = config.hidden_size, config.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(c, config.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(c, config.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(c, config.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, c, bias=False)
        self.attn_fn = sdpa_attention
        self.rope_fn = rope.apply_rotary

    def forward(self, x, cos, sin):  # x (B, T, C)
        B, T, _ = x.shape
        # Heads are counted from the weights, not the config: under TP each rank holds nh/tp of them.
        nh = self.q_proj.weight.shape[0] // self.head_dim
        nkv = self.k_proj.weight.shape[0] // self.head_dim
        q = self.q_proj(x).view(B, T, nh, self.head_dim).transpose(1, 2)    # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, nkv, self.head_dim).transpose(1, 2)   # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, nkv, self.head_dim).transpose(1, 2)   # (B, nkv, T, hd)
        q, k = self.rope_fn(q, k, cos, sin)
        y = self.attn_fn(q, k, v)                                           # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, nh * self.head_dim)             # (B, T, nh·hd)
        return self.o_proj(y)                                               # (B, T, C)


def silu_mul(gate, up):
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        c, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(c, f, bias=False)
        self.up_proj = nn.Linear(c, f, bias=False)
        self.down_proj = nn.Linear(f, c, bias=False)
        self.act_fn = silu_mul

    def forward(self, x):  # (B, T, C)
        return self.down_proj(self.act_fn(self.gate_proj(x), self.up_proj(x)))   # (B, T, F) -> (B, T, C)


def split_auxiliary(out):
    """An MLP returns its output (B, T, C), or (output, auxiliary loss): 07's MoE block returns its
    α-weighted load-balancing loss. -> (output, auxiliary loss or 0.0)."""
    return out if isinstance(out, tuple) else (out, 0.0)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin):  # (B, T, C) -> (B, T, C), the MLP's auxiliary loss (0.0 without one)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        y, aux = split_auxiliary(self.mlp(self.post_attention_layernorm(x)))
        return x + y, aux


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def rotary(self, position_ids, dtype):
        return rope.rotary_cos_sin(position_ids, self.config, dtype)

    def forward(self, input_ids, position_ids=None):  # (B, T) -> (B, T, C), Σ of the layers' auxiliary losses
        x = self.embed_tokens(input_ids)
        if position_ids is None:  # context parallelism passes the positions of its shard instead
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = self.rotary(position_ids, x.dtype)                        # (T, hd)
        aux = 0.0
        for layer in self.layers:
            x, layer_aux = layer(x, cos, sin)
            aux = aux + layer_aux
        return self.norm(x), aux


def cross_entropy_loss(hidden, lm_head, labels):
    """Mean next-token loss over all tokens: hidden (B, T, C), labels (B, T); -100 is ignored."""
    logits = lm_head(hidden)                                                 # (B, T, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))     # bf16 -> fp32 for the softmax
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.loss_fn = cross_entropy_loss
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Hugging Face's Llama init: normal(0, 0.02) for matrices, ones for norms."""
        for name, p in self.named_parameters():
            if p.is_meta:   # a shape without values (materialize.py draws them): nothing to fill
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, self.config.initializer_range)

    def forward(self, input_ids, labels=None, position_ids=None):
        hidden, aux = self.model(input_ids, position_ids)                     # (B, T, C), () or 0.0
        if labels is None:
            return self.lm_head(hidden)                                        # (B, T, V)
        return self.loss_fn(hidden, self.lm_head, labels) + aux                # scalar: task + auxiliary
