"""Tiny configurations of every supported family, built from transformers' own config and model classes.

Each entry exercises the features its family adds: Llama 3.2's llama3 RoPE and tied embeddings,
Qwen2's q/k/v biases and sliding suffix, Qwen3's q/k norms with an independent head_dim, Gemma 3's
norms, embedding scale, GELU-tanh, query_pre_attn_scalar, interleaved local/global layers with a RoPE
base per layer type and a scaled global RoPE, Phi-3's fused projections with partial rotary and
longrope, SmolLM3's no-RoPE layers, Mistral's window on every layer. Windows are 4 positions, so a
12-token test sequence runs well past them.
"""

from __future__ import annotations

from pathlib import Path

import torch

NAMES = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "smollm3", "mistral")
WINDOW = 4
_SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_config(name: str):
    """transformers' config object of the tiny `name` model."""
    import transformers as tf

    if name == "llama":
        return tf.LlamaConfig(**_SIZES, num_hidden_layers=3, head_dim=16, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 16})
    if name == "qwen2":
        return tf.Qwen2Config(**_SIZES, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                              max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if name == "qwen3":
        return tf.Qwen3Config(**_SIZES, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                               "original_max_position_embeddings": 32})
    if name == "gemma3":
        return tf.Gemma3TextConfig(**{**_SIZES, "num_key_value_heads": 1}, num_hidden_layers=3, head_dim=32,
                                   query_pre_attn_scalar=24, sliding_window=WINDOW,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1e6}})
    if name == "phi3":
        half = int(16 * 0.5) // 2  # rotary dims / 2 frequencies
        return tf.Phi3Config(**_SIZES, num_hidden_layers=2, original_max_position_embeddings=64,
                             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5,
                                              "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                              "long_factor": [2.0 + 0.5 * i for i in range(half)],
                                              "original_max_position_embeddings": 64})
    if name == "smollm3":
        return tf.SmolLM3Config(**_SIZES, num_hidden_layers=4, no_rope_layer_interval=2,
                                rope_parameters={"rope_type": "default", "rope_theta": 2e6})
    if name == "mistral":
        return tf.MistralConfig(**_SIZES, num_hidden_layers=2, sliding_window=WINDOW,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    raise KeyError(name)


def hf_model(name: str, seed: int = 0):
    """The tiny transformers model with random weights large enough for peaked, distinct logits."""
    return random_hf_model(hf_config(name), gemma=name == "gemma3", seed=seed)


def save_hf(name: str, folder: Path, seed: int = 0):
    """Write the tiny model as a Hugging Face folder; returns the transformers model."""
    model = hf_model(name, seed)
    model.save_pretrained(folder)
    return model


def llamacpp_config(name: str):
    """The family's tiny transformers config, changed only where llama.cpp hard-codes another choice:
    no sliding window for Qwen2 and Mistral (llama.cpp's qwen2 and llama run every layer globally),
    no RoPE on every 4th layer for SmolLM3 (the tiny config has every 2nd), Gemma 3's attention scaled
    by head_dim, Phi-3's longrope with an original context llama.cpp's stays within."""
    import transformers as tf

    if name == "qwen2":
        return tf.Qwen2Config(**_SIZES, num_hidden_layers=3, use_sliding_window=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if name == "mistral":
        return tf.MistralConfig(**_SIZES, num_hidden_layers=2, sliding_window=None,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if name == "smollm3":
        return tf.SmolLM3Config(**_SIZES, num_hidden_layers=4, no_rope_layer_interval=4,
                                rope_parameters={"rope_type": "default", "rope_theta": 2e6})
    if name == "phi3":  # llama.cpp sizes its context to 256 at least, and past the original one uses the
        # long factors; our model applies the short ones (contexts up to the original length)
        half = int(16 * 0.5) // 2
        return tf.Phi3Config(**{**_SIZES, "max_position_embeddings": 512}, num_hidden_layers=2,
                             original_max_position_embeddings=256,
                             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5,
                                              "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                              "long_factor": [2.0 + 0.5 * i for i in range(half)],
                                              "original_max_position_embeddings": 256})
    config = hf_config(name)
    if name == "gemma3":  # llama.cpp scales scores by 1/sqrt(head_dim) whatever query_pre_attn_scalar says
        config.query_pre_attn_scalar = config.head_dim
    return config


def random_hf_model(config, gemma: bool, seed: int = 0):
    """A transformers model of `config` with random weights; Gemma's norms multiply by 1 + w, so their
    stored w stays near 0 and every gain near 1 either way."""
    import transformers as tf

    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(-0.2, 0.2) if gemma else p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.15)
    return model


def byte_tokenizer(vocab_size: int = 128):
    """A byte-level BPE of `vocab_size` tokens, nearly all single characters: the families' vocabularies are
    128 tokens, fewer than any trained byte-level BPE. The tests feed ids; llama.cpp only loads it."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from edgefinfer.tokenization.tokenizer import Tokenizer

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())[:vocab_size - 2] + ["th", "he"]  # llama.cpp needs merges
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[("t", "h"), ("h", "e")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend)


def family_gguf(name: str, folder):
    """(our model, its F32 GGUF at folder/NAME.gguf) for family `name` as llama.cpp runs it (`llamacpp_config`),
    with the byte-level tokenizer; the HF folder is folder/hf."""
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.compile.gguf_export import export_gguf

    random_hf_model(llamacpp_config(name), gemma=name == "gemma3").save_pretrained(folder / "hf")
    ours = load_model(folder / "hf")
    path = folder / f"{name}.gguf"
    export_gguf(ours, byte_tokenizer(ours.config.vocab_size), path, "f32")
    return ours, path
