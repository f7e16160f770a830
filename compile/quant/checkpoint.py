"""Quantized checkpoints: a Hugging Face-style folder that reloads into the same quantized eager model.

    config.json          the model's config plus a `quantization_config` block:
                           quant_method "edgefinfer", format_version, the recipe, and per module
                           {kind, bits, group_size (resolved), symmetric, act_quant}
    model.safetensors    float tensors as usual; a quantized module `<name>` stores
                           <name>.qweight  int8 [out, in] codes (or float8_e4m3fn for fp8)
                           <name>.scales   float16 [out, in / group] (float32 [out, 1] for fp8)
                           <name>.zeros    int8 [out, in / group] (integer formats)
                         a head tied to quantized embeddings is not stored (`tied_head`: true)
    tokenizer files      copied from the source folder

Codes are kept unpacked (one int8 per code) so any exporter can read them without a bit-unpacker;
`size_bytes` in reports is the packed size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from edgefinfer.files.atomic import atomic_dir
from edgefinfer.model.checkpoint import load_config, load_state_dict, write_side_files
from edgefinfer.compile.quant.apply import LM_HEAD, set_module
from edgefinfer.compile.quant.modules import Fp8Linear, QuantEmbedding, QuantLinear, tied_head
from edgefinfer.compile.quant.recipe import QuantRecipe, WeightFormat
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer

QUANT_METHOD = "edgefinfer"
FORMAT_VERSION = 1


def quantization_config(model: Transformer, recipe: QuantRecipe) -> dict[str, Any]:
    modules: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        if isinstance(module, (QuantLinear, QuantEmbedding, Fp8Linear)):
            if name == LM_HEAD and is_tied(model):
                continue
            entry = {**module.fmt.to_dict(), "act_quant": bool(getattr(module, "act_quant", False))}
            if getattr(module, "act_split", 0):  # written only when set, so other checkpoints stay as they were
                entry["act_split"] = int(module.act_split)
            if getattr(module, "float_cols", None) is not None:  # the indices are a tensor of the checkpoint
                entry["float_cols"] = int(module.float_cols.numel())
            if isinstance(module, (QuantLinear, QuantEmbedding)):
                entry["group"] = module.group_size  # resolved: per-channel is the row length
            modules[name] = entry
    tied = is_tied(model)
    return {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "recipe": recipe.to_dict(),
            "tied_head": tied, "tied_head_act_quant": tied and bool(getattr(model.lm_head, "act_quant", False)),
            "modules": modules}


def is_tied(model: Transformer) -> bool:
    """Whether the output head shares the *quantized* embedding's codes."""
    head, emb = model.lm_head, model.model.embed_tokens
    return isinstance(head, QuantLinear) and isinstance(emb, QuantEmbedding) and head.qweight is emb.qweight


def save_quantized(model: Transformer, recipe: QuantRecipe, path: str | Path, tokenizer_dir: str | Path | None = None,
                   extra_files: dict[str, str] | None = None) -> Path:
    """Write `model` (quantized by `quantize_model`) as a folder at `path`, atomically."""
    dest = Path(path)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if is_tied(model) or model.config.tie_word_embeddings:  # the head is rebuilt from the embedding
        state = {k: v for k, v in state.items() if not k.startswith(LM_HEAD + ".")}
    hf = model.config.to_hf()
    hf["quantization_config"] = quantization_config(model, recipe)
    with atomic_dir(dest) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt", "quant_method": QUANT_METHOD})
        write_side_files(tmp, tokenizer_dir, extra_files)
    return dest


def read_quantization_config(path: str | Path) -> dict[str, Any] | None:
    """The folder's quantization_config, or None for a float checkpoint."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if qc.get("quant_method") != QUANT_METHOD:
        raise UserError(f"{path} is quantized with {qc.get('quant_method')!r}; edgefinfer reads only its own "
                        "quantized checkpoints (quantize the float model with `edgefinfer quantize`)")
    if qc.get("format_version", 0) > FORMAT_VERSION:
        raise UserError(f"{path} uses quantized format version {qc['format_version']}; this edgefinfer reads "
                        f"up to {FORMAT_VERSION}: upgrade edgefinfer")
    return qc


def load_quantized(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Transformer, QuantRecipe]:
    """Rebuild the quantized eager model saved by `save_quantized` (codes, scales, zeros bit-exact)."""
    config = load_config(path)
    qc = read_quantization_config(path)
    if qc is None:
        raise UserError(f"{path} is not a quantized checkpoint (no quantization_config in config.json)")
    config = config.replace(extra={k: v for k, v in config.extra.items() if k != "quantization_config"})
    recipe = QuantRecipe.from_dict(qc["recipe"])
    with torch.device("meta"):
        model = Transformer(config)
        for name, entry in qc["modules"].items():
            set_module(model, name, _empty_module(model, name, entry))
    state = load_state_dict(path)
    expected = set(model.state_dict())
    if qc.get("tied_head") or config.tie_word_embeddings:
        expected = {k for k in expected if not k.startswith(LM_HEAD + ".")}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise UserError(f"tensors in {path} do not match its quantization_config: {what}")
    model.load_state_dict(state, strict=False, assign=True)
    if qc.get("tied_head"):
        model.lm_head = tied_head(model.model.embed_tokens, bool(qc.get("tied_head_act_quant", False)))
    elif config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rope()
    for p in model.parameters():  # float parameters only: codes and scales keep their storage types
        p.data = p.data.to(dtype)
    return model.eval(), recipe


def _empty_module(model: Transformer, name: str, entry: dict[str, Any]) -> nn.Module:
    fmt = WeightFormat.from_dict(entry)
    old = model.get_submodule(name)
    if isinstance(old, nn.Embedding):
        return QuantEmbedding(old.num_embeddings, old.embedding_dim, fmt, name)
    if fmt.kind == "fp8":
        return Fp8Linear(old.in_features, old.out_features, old.bias is not None)
    return QuantLinear(old.in_features, old.out_features, fmt, old.bias is not None, entry.get("act_quant", False),
                       name, act_split=int(entry.get("act_split", 0)), float_cols=int(entry.get("float_cols", 0)))
