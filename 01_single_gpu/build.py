"""What every trainer builds before its first step: the device, the data, the seeded model (plumbing).

Every folder starts from the same model: 01's Llama seeded with --seed (or loaded from --init-from HF
weights), in the parameters' dtype, with the --kernels/--attn pieces swapped in (kernels/patch.py), so
that a parallel layout that slices it reproduces 01's numbers from the first step. Mixed precision
(playbook §2.1): --dtype bfloat16 keeps fp32 master weights and runs the forward and backward under bf16
autocast; float32 and float64 run everything in that type.
"""
import os
from importlib import import_module

import torch

data = import_module("01_single_gpu.data")
hf_io = import_module("01_single_gpu.hf_io")
modeling = import_module("01_single_gpu.model")


def device_of(args):
    if args.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def param_dtype(args):  # bfloat16 trains fp32 master weights under bf16 autocast
    return torch.float64 if args.dtype == "float64" else torch.float32


def activation_element_bytes(args) -> int:
    """Bytes per activation element: 2 under bf16 autocast, else the parameters' dtype's."""
    return 2 if args.dtype == "bfloat16" else torch.empty(0, dtype=param_dtype(args)).element_size()


def autocast(args, device):
    """bf16 autocast for --dtype bfloat16 (fp32 master weights stay fp32), else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")


def load_data(args):
    """(tokenizer, windows of seq_len + 1 tokens) for --dataset/--tokenizer/--text-column (data.py)."""
    tokenizer = data.load_tokenizer(args.tokenizer)
    return tokenizer, data.build_dataset(args.dataset, tokenizer, args.seq_len, text_column=args.text_column)


def build_model(args, config):
    """The full model, seeded identically in every folder (later folders slice it per rank)."""
    torch.manual_seed(args.seed)
    model = modeling.LlamaForCausalLM(config).to(param_dtype(args))
    if args.init_from:
        hf_io.load_hf_into(model, args.init_from)
    if (args.kernels, args.attn) != ("torch", "sdpa"):
        import_module("kernels.patch").apply_kernels(model, args.kernels, args.attn)
    return model
