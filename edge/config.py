"""The one model configuration: a Llama-family decoder (Llama, Qwen2, Mistral-style sliding window).

`ModelConfig` is read from and written to a Hugging Face `config.json`. Only the fields that change
the maths are kept; `to_hf()` writes what transformers needs to rebuild the same model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from edgefinfer.errors import UserError



def normalize_eos_ids(eos_token_id: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """A config's `eos_token_id` (one id, a list of them, or None) as a tuple of ids."""
    if eos_token_id is None:
        return ()
    return tuple(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else (eos_token_id,)


# HF `architectures[0]` / `model_type` we implement, mapped to our family name.
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
_MODEL_TYPES = {v: k for k, v in _ARCHITECTURES.items()}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    model_type: str = "llama"  # llama | qwen2 | mistral
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on q/k/v projections
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # attend to the last `sliding_window` positions (incl. self)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    hidden_act: str = "silu"
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # unknown HF keys, kept verbatim

    def __post_init__(self) -> None:
        if self.model_type not in _MODEL_TYPES:
            raise UserError(
                f"unsupported model_type {self.model_type!r}: edgefinfer implements "
                f"{', '.join(sorted(_MODEL_TYPES))}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention needs whole groups)"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.hidden_act != "silu":
            raise UserError(f"unsupported hidden_act {self.hidden_act!r}: only 'silu' (SwiGLU) is implemented")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def eos_token_ids(self) -> list[int]:
        return list(normalize_eos_ids(self.eos_token_id))

    @property
    def architecture(self) -> str:
        return _MODEL_TYPES[self.model_type]

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_parameters(self) -> int:
        """Parameter count implied by the config (tied embeddings counted once)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.dim_per_head
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        attn = d * q + 2 * d * kv + q * d
        attn += (q + 2 * kv) * self.qkv_bias + d * self.o_bias
        mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + d

    # ---- Hugging Face config.json ------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        arch = (hf.get("architectures") or [None])[0]
        model_type = hf.get("model_type") or _ARCHITECTURES.get(arch or "")
        if model_type not in _MODEL_TYPES or (arch is not None and arch not in _ARCHITECTURES):
            raise UserError(
                f"unsupported architecture {arch or model_type!r}: edgefinfer implements "
                f"{', '.join(_ARCHITECTURES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise UserError(f"unsupported hidden_act {hf['hidden_act']!r}: only 'silu' (SwiGLU) is implemented")
        # Mistral keeps `sliding_window` on; Qwen2 only when `use_sliding_window` is true.
        window = hf.get("sliding_window")
        if model_type == "qwen2" and not hf.get("use_sliding_window", False):
            window = None
        if model_type == "llama":
            window = None
        attention_bias = bool(hf.get("attention_bias", False))
        known = {f.name for f in dataclasses.fields(cls)} | {"architectures", "use_sliding_window", "attention_bias"}
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        rope_params = hf.get("rope_parameters")  # transformers >= 5 nests rope settings here
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) not in ("default", "llama3"):
            raise UserError(
                f"unsupported rope_scaling {rope_scaling!r}: edgefinfer implements default and llama3 RoPE"
            )
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            model_type=model_type,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6 if model_type != "llama" else 1e-5),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            hidden_act=hf.get("hidden_act", "silu"),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            extra={k: v for k, v in hf.items() if k not in known and k not in ("rope_parameters", "dtype")},
        )

    def to_hf(self) -> dict[str, Any]:
        hf: dict[str, Any] = dict(self.extra)
        hf.update(
            architectures=[self.architecture],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.dim_per_head,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            torch_dtype=self.torch_dtype,
            use_cache=True,
        )
        if self.model_type == "llama":
            hf.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
            if self.qkv_bias != self.o_bias:
                raise UserError("a Llama checkpoint has either biases on all of q/k/v/o or on none")
        elif self.model_type == "qwen2":
            hf.update(use_sliding_window=self.sliding_window is not None,
                      sliding_window=self.sliding_window, max_window_layers=self.num_hidden_layers)
        else:
            hf.update(sliding_window=self.sliding_window)
        return hf
