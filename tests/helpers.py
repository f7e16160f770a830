"""Tiny random models shared by the unit tests."""

from __future__ import annotations

import torch

from edgefinfer.config import ModelConfig
from edgefinfer.model import Transformer


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, eos_token_id=96)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    """A random tiny model whose weights are large enough to give peaked, non-trivial distributions."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.15)
    return model.eval()
