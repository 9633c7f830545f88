"""Hugging Face format in and out: a directory with `config.json` + `model.safetensors`.

Plumbing, not a technique: `--init-from DIR` starts training from such a directory (a real Llama
checkpoint, or one saved by `save_hf`), and the parity test round-trips through it. Sharded
checkpoints (`model.safetensors.index.json`) are read too. Later folders shard the loaded full
state dict themselves (build the full weight, then slice it per rank). `check_hf_dir` checks a
directory before training from the safetensors headers alone: every tensor there, in its shape.
"""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
REQUIRED_KEYS = CONFIG_KEYS[:5]                  # the shapes; the others have defaults


def rope_from_hf(raw: dict):
    """(rope_theta, rope_scaling or None) from either layout of config.json.

    transformers 5 writes "rope_parameters": {"rope_theta", "rope_type", and the kind's keys}. Before it,
    rope_theta was top-level and the scaling a "rope_scaling" dict that names its kind "type" (older
    checkpoints) or "rope_type"; transformers 5 keeps "type" beside "rope_type" when it converts one.
    """
    rope = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    if any(isinstance(value, dict) for value in rope.values()):
        raise ValueError("per-layer-type rope_parameters are not a Llama layout")
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    kind = rope.pop("rope_type", None) or rope.pop("type", "default")
    rope.pop("type", None)
    return theta, (None if kind == "default" else {"rope_type": kind, **rope})


def config_from_hf(directory, config_cls):
    """The config of an HF directory's config.json; every problem is one ValueError naming the directory."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory}: no config.json in it: pass the folder save_pretrained (or "
                         f"export_hf.py) wrote, config.json beside the safetensors")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}): repair it, or save the model again with "
                         f"save_pretrained") from None
    missing = [key for key in REQUIRED_KEYS if key not in raw]
    kind = raw.get("model_type", "llama")
    if missing:
        fix = (f"add {'it' if len(missing) == 1 else 'them'} (a Llama's config.json has them all)"
               if kind == "llama" else f"it describes a {kind} model, not a Llama: pass a Llama's folder")
        raise ValueError(f"{directory}: config.json lacks {', '.join(missing)}: {fix}")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError(f"{directory}: attention/mlp biases are not part of this Llama model: pass a Llama "
                         f"without them")
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim * raw["num_attention_heads"] != raw["hidden_size"]:
        raise ValueError(f"{directory}: head_dim={head_dim}, but hidden_size/num_attention_heads is "
                         f"{raw['hidden_size'] / raw['num_attention_heads']:g}, the width of this model's "
                         f"heads: pass a model whose head_dim is hidden_size/num_attention_heads")
    raw.setdefault("num_key_value_heads", raw["num_attention_heads"])
    try:
        rope_theta, rope_scaling = rope_from_hf(raw)
        return config_cls(**{k: raw[k] for k in CONFIG_KEYS if k in raw}, rope_theta=rope_theta,
                          rope_scaling=rope_scaling)
    except ValueError as error:
        raise ValueError(f"{directory}: {error}") from None


def weight_files(directory) -> list:
    """The safetensors files of an HF directory: those its index names, or model.safetensors."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as error:
            raise ValueError(f"{index} is not a safetensors index ({error!r}): save the model again with "
                             f"save_pretrained") from None
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{directory}: no model.safetensors (or model.safetensors.index.json) in it: "
                         f"pass a folder saved with save_pretrained / save_hf")
    for name in files:
        if not (directory / name).is_file():
            raise ValueError(f"{directory}: model.safetensors.index.json names {name}, which is not there: "
                             f"copy it into the folder")
    return files


def read_safetensors_header(path) -> dict:
    """name -> shape of the tensors of a safetensors file, from its header alone (8 bytes of length, then
    JSON); a ValueError naming the file if it is not one, or shorter than the tensors it declares."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or length > size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = 8 + length + max((v["data_offsets"][1] for v in tensors.values()), default=0)
        if end > size:
            raise ValueError(f"its tensors end at byte {end}, the file has {size}: a torn copy")
        return {k: tuple(v["shape"]) for k, v in tensors.items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a readable safetensors file ({error}): copy it again, or save the "
                         f"model again") from None


def check_hf_dir(directory, config_cls, model_cls, flag="--init-from"):
    """--init-from (generate.py's --hf-dir) before loading: a folder whose config.json makes a config and
    whose weight files hold exactly that model's tensors in their shapes (headers only: nothing is loaded)."""
    if not Path(directory).is_dir():
        raise ValueError(f"{flag} {directory}: no such folder: pass a local folder with config.json and "
                         f"model.safetensors (a Hugging Face Llama)")
    config = config_from_hf(directory, config_cls)
    found = {}
    for name in weight_files(directory):
        found.update(read_safetensors_header(Path(directory) / name))
    with torch.device("meta"):   # shapes only: no memory, no initialisation
        expected = {k: tuple(v.shape) for k, v in model_cls(config).state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        found.pop("lm_head.weight", None)
    missing = expected.keys() - found.keys()
    unexpected = found.keys() - expected.keys() - {"model.rotary_emb.inv_freq"}
    together = "pass a folder whose config.json and weights were saved together"
    if missing or unexpected:
        raise ValueError(f"{directory}: the weight files lack {sorted(missing)[:4]} and hold unexpected "
                         f"{sorted(unexpected)[:4]}: they do not belong to its config.json; {together}")
    for name, shape in expected.items():
        if found[name] != shape:
            raise ValueError(f"{directory}: {name} has shape {found[name]}, config.json implies {shape}: the "
                             f"weights belong to another config.json; {together}")


def load_hf_state_dict(directory) -> dict:
    state = {}
    for name in weight_files(directory):
        state.update(load_file(Path(directory) / name))
    return state


def load_hf_into(model, directory):
    """Copy the weights of an HF directory into `model` (same config), casting to its dtype."""
    state = load_hf_state_dict(directory)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    own = model.state_dict()
    if model.config.tie_word_embeddings:
        own.pop("lm_head.weight", None)
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys() - {"model.rotary_emb.inv_freq"}
    if missing or unexpected:
        raise ValueError(f"{directory}: missing weights {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")
    with torch.no_grad():
        for name, tensor in own.items():
            if tensor.shape != state[name].shape:
                raise ValueError(f"{directory}: {name} has shape {tuple(state[name].shape)}, "
                                 f"the model expects {tuple(tensor.shape)}")
            tensor.copy_(state[name])


def save_hf(model, directory):
    """Write `config.json` + `model.safetensors` that `transformers.LlamaForCausalLM` can load."""
    save_hf_state({k: v.detach() for k, v in model.state_dict().items()}, model.config, directory)


def save_hf_state(state: dict, cfg, directory, max_shard_bytes=None):
    """`state` (01's parameter names -> tensors) and its LlamaConfig as a Hugging Face directory: one
    model.safetensors, or files of at most `max_shard_bytes` and their model.safetensors.index.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(cfg, k) for k in CONFIG_KEYS}
    # transformers 5's layout, as its save_pretrained writes it (rope_from_hf reads the older one too)
    config["rope_parameters"] = {"rope_theta": cfg.rope_theta, "rope_type": "default",
                                 **(cfg.rope_scaling or {})}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  head_dim=cfg.head_dim, attention_bias=False, mlp_bias=False,
                  initializer_range=cfg.initializer_range,
                  torch_dtype=str(next(iter(state.values())).dtype)[6:])
    state = {k: v.contiguous().cpu() for k, v in state.items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    shards = split_into_shards(state, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)])
    for name, shard in zip(names, shards):
        save_file(shard, directory / name, metadata={"format": "pt"})
    if len(shards) > 1:             # as save_pretrained writes it: which file holds each tensor
        index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())},
                 "weight_map": {key: name for name, shard in zip(names, shards) for key in shard}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def split_into_shards(state: dict, max_shard_bytes=None) -> list:
    """The tensors in order, in groups of at most `max_shard_bytes` (a larger one alone), or all in one."""
    shards, size = [{}], 0
    for name, tensor in state.items():
        if max_shard_bytes and shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards, size = shards + [{}], 0
        shards[-1][name], size = tensor, size + tensor.nbytes
    return shards
