"""Where a student comes from: structured pruning of the teacher (Minitron), a config, or a checkpoint.

Logit distillation compares the teacher's and the student's distributions token id by token id, so the
two must share the tokenizer exactly. `tokenizer_fingerprint` hashes the vocabulary (token -> id,
added tokens included) in a canonical order, so formatting differences between two tokenizer.json
files do not matter but any different token or id does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from edgefinfer.model.config import ModelConfig
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer
from edgefinfer.prune.structured import Kept, parse_budget, prune_structured, solve_budget


def tokenizer_fingerprint(folder: str | Path) -> str:
    """sha256 of the canonical vocabulary of a folder's tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer

    file = Path(folder) / "tokenizer.json"
    if not file.is_file():
        raise UserError(f"{folder} has no tokenizer.json; distillation needs the teacher's tokenizer beside the weights")
    try:
        vocab = HFTokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise UserError(f"{file} could not be read: {e}") from None
    return hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode()).hexdigest()


def check_compatible(teacher_dir: str | Path, student_dir: str | Path, teacher: ModelConfig,
                     student: ModelConfig) -> None:
    """One-line UserError unless teacher and student share tokenizer and vocabulary size."""
    if tokenizer_fingerprint(teacher_dir) != tokenizer_fingerprint(student_dir):
        raise UserError(f"teacher {teacher_dir} and student {student_dir} have different tokenizers; logit "
                        "distillation needs the same vocabulary (derive the student from the teacher instead)")
    check_vocab(teacher, student)


def check_vocab(teacher: ModelConfig, student: ModelConfig) -> None:
    if teacher.vocab_size != student.vocab_size:
        raise UserError(f"teacher vocabulary ({teacher.vocab_size}) and student vocabulary ({student.vocab_size}) "
                        "differ; the student must use the teacher's tokenizer and vocab_size")


def init_weights(model: Transformer, seed: int, std: float = 0.02) -> Transformer:
    """HF-style initialisation: normal(0, std) matrices and embeddings, unit norms, zero biases."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    return model


def config_from_json(spec: dict[str, Any], teacher: ModelConfig) -> ModelConfig:
    """A full HF config.json, or HF keys that override the teacher's (e.g. {"num_hidden_layers": 8})."""
    if "model_type" in spec or "architectures" in spec:
        config = ModelConfig.from_hf(spec)
    else:
        base = teacher.to_hf()
        if {"hidden_size", "num_attention_heads"} & set(spec) and "head_dim" not in spec:
            base.pop("head_dim")  # re-derive it from the new width and head count
        if "num_hidden_layers" in spec:  # per-layer lists follow the family's own pattern for the new depth
            for key in ("layer_types", "no_rope_layers"):
                if key not in spec:
                    base.pop(key, None)
        try:
            config = ModelConfig.from_hf({**base, **spec})
        except (TypeError, KeyError) as e:
            raise UserError(f"student config is not valid: {e}") from None
    check_vocab(teacher, config)
    return config


def student_from_config(config: ModelConfig, seed: int = 0) -> Transformer:
    return init_weights(Transformer(config), seed).train()


def student_from_pruning(teacher: Transformer, calib: torch.Tensor, params: str | float, layers: int | None = None,
                         kv_heads: int | None = None, heads: int | None = None, multiple_of: int = 32
                         ) -> tuple[Transformer, Kept]:
    """Minitron: score the teacher on calibration blocks and cut it to a parameter budget."""
    shape = solve_budget(teacher.config, parse_budget(params, teacher.config), layers, kv_heads, heads, multiple_of)
    student, kept = prune_structured(teacher, calib, shape)
    return student.train(), kept
