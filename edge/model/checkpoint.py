"""Hugging Face checkpoint folders in and out.

A folder holds `config.json`, `model.safetensors` (or shards listed in `model.safetensors.index.json`),
and the tokenizer files. Saving writes a temporary sibling folder and renames it into place, so an
interrupted save never leaves a half-written checkpoint at the destination.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from edgefinfer.files.atomic import atomic_dir
from edgefinfer.model.config import ModelConfig
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer
from edgefinfer.files.untrusted import check_hf_config, read_json

# Files that travel with the weights when a checkpoint is re-saved.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise UserError(f"unknown dtype {name!r}: use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_config(path: str | Path) -> ModelConfig:
    folder = _existing_folder(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{folder} has no config.json: is it a Hugging Face model folder?")
    hf = read_json(cfg_file, "fix it or re-download the model")
    check_hf_config(hf, cfg_file)
    try:
        return ModelConfig.from_hf(hf)
    except KeyError as e:
        raise UserError(f"{cfg_file} lacks the required key {e.args[0]!r}") from None


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's safetensors file(s), verified to be readable."""
    folder = _existing_folder(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "fix it or re-download the model").get("weight_map")
        if not isinstance(weight_map, dict) or not all(_shard_name(v) for v in weight_map.values()):
            raise UserError(f"{index} is not a valid safetensors index (needs a 'weight_map' of tensor name "
                            f"-> file name in the folder)")
        shards = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise UserError(f"{folder} has no model.safetensors (nor a model.safetensors.index.json)")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        file = folder / shard
        if not file.is_file():
            raise UserError(f"shard {shard} listed in {index.name} is missing from {folder}")
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError, ValueError, TypeError) as e:  # safetensors checks the header
            raise UserError(f"{file} is truncated or corrupt ({e}); re-download or re-save it") from None
    return state


def load_model(path: str | Path, dtype: str | torch.dtype | None = "float32") -> Transformer:
    """Load a HF folder into our Transformer (eval mode). dtype None keeps the stored dtype."""
    config = load_config(path)
    if "quantization_config" in config.extra:
        method = config.extra["quantization_config"].get("recipe", {})
        raise UserError(f"{path} is a quantized checkpoint ({method.get('name', 'edgefinfer') if isinstance(method, dict) else method}); "
                        f"use it with `edgefinfer build --model {path}` or load it with "
                        f"edgefinfer.compile.quant.checkpoint.load_quantized")
    state = from_hf_state(load_state_dict(path), config)
    # transformers omits lm_head.weight when embeddings are tied.
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    with torch.device("meta"):
        model = Transformer(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise UserError(f"weights in {path} do not match its config.json: {what} "
                        f"({len(missing)} missing, {len(unexpected)} unexpected)")
    for name, tensor in state.items():
        want = model.get_parameter(name).shape
        if tensor.shape != want:
            raise UserError(f"{name} in {path} has shape {tuple(tensor.shape)}, config.json implies {tuple(want)}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rope()  # buffers were created on the meta device
    if dtype is not None:
        model = model.to(parse_dtype(dtype))
    return model.eval()


def save_model(model: Transformer, path: str | Path, tokenizer_dir: str | Path | None = None,
               max_shard_bytes: int | None = None, extra_files: dict[str, str] | None = None) -> Path:
    """Write `model` as a HF folder at `path` (atomically). Tokenizer files are copied from `tokenizer_dir`."""
    dest = Path(path)
    config = model.config.replace(torch_dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
    state = to_hf_state({k: v.detach().contiguous() for k, v in model.state_dict().items()}, config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; HF re-ties on load
    with atomic_dir(dest) as tmp:
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
        _write_weights(state, tmp, max_shard_bytes)
        write_side_files(tmp, tokenizer_dir, extra_files)
    return dest


def from_hf_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A family's checkpoint tensors -> our model's: fused q|k|v and gate|up split (Phi-3), norm gains
    with the family's offset added (Gemma stores w for a gain of 1 + w)."""
    out: dict[str, torch.Tensor] = {}
    q, kv = config.num_attention_heads * config.dim_per_head, config.num_key_value_heads * config.dim_per_head
    for name, t in state.items():
        if config.family.fused_qkv and name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            if t.shape[0] != q + 2 * kv:
                raise UserError(f"{name} has {t.shape[0]} rows, config.json implies q + 2 kv = {q + 2 * kv}")
            out[base + "q_proj.weight"], out[base + "k_proj.weight"], out[base + "v_proj.weight"] = \
                (p.contiguous() for p in t.split([q, kv, kv]))
        elif config.family.fused_gate_up and name.endswith("mlp.gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            if t.shape[0] != 2 * config.intermediate_size:
                raise UserError(f"{name} has {t.shape[0]} rows, config.json implies 2 x {config.intermediate_size}")
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = (p.contiguous() for p in t.chunk(2))
        elif config.norm_offset and name.endswith("norm.weight"):
            out[name] = t + config.norm_offset
        else:
            out[name] = t
    return out


def to_hf_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `from_hf_state`: our tensors in the family's checkpoint layout."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if config.family.fused_qkv and name.endswith("self_attn.q_proj.weight"):
            base = name.removesuffix("q_proj.weight")
            out[base + "qkv_proj.weight"] = torch.cat([t, state[base + "k_proj.weight"], state[base + "v_proj.weight"]])
        elif config.family.fused_qkv and name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            continue
        elif config.family.fused_gate_up and name.endswith("mlp.gate_proj.weight"):
            base = name.removesuffix("gate_proj.weight")
            out[base + "gate_up_proj.weight"] = torch.cat([t, state[base + "up_proj.weight"]])
        elif config.family.fused_gate_up and name.endswith("mlp.up_proj.weight"):
            continue
        elif config.norm_offset and name.endswith("norm.weight"):
            out[name] = t - config.norm_offset
        else:
            out[name] = t
    return out


def write_side_files(folder: Path, tokenizer_dir: str | Path | None, extra_files: dict[str, str] | None) -> None:
    """The tokenizer files of `tokenizer_dir` (those present) and any extra text files, into `folder`."""
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copyfile(src, folder / name)
    for name, text in (extra_files or {}).items():
        (folder / name).write_text(text)


def _write_weights(state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int | None) -> None:
    meta = {"format": "pt"}
    total = sum(t.numel() * t.element_size() for t in state.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(state, folder / "model.safetensors", metadata=meta)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / fname, metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _shard_name(name: object) -> bool:
    """A plain file name: an index may not point outside its folder."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _existing_folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise UserError(f"model folder {folder} does not exist (try `edgefinfer pull smollm2-135m`)")
    if not folder.is_dir():
        raise UserError(f"{folder} is a file; pass the Hugging Face model folder that contains it")
    return folder
