"""Tiny random models shared by the unit tests."""

from __future__ import annotations

import os

import torch

from edgefinfer.model.config import ModelConfig
from edgefinfer.model.transformer import Transformer

# Threads for torch (conftest) and for the llama.cpp engines tests size themselves: one, so two
# workers on two cores do not wait on each other's spinning OpenMP threads.
TEST_THREADS = int(os.environ.get("EDGEFINFER_TEST_THREADS", "1"))


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


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
         "want of a wife. However little known the feelings or views of such a man may be on his first entering "
         "a neighbourhood, this truth is so well fixed in the minds of the surrounding families. Prices: 12, 345, "
         "6789 — naïve café déjà vu ✓ 你好.\n") * 20


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE trained in-process (a second), with ChatML special tokens and template."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    from edgefinfer.tokenization.tokenizer import Tokenizer

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([_TEXT], trainer)
    return Tokenizer(backend, bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=CHATML)
