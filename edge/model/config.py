"""The one model configuration: a decoder described by typed features, not by a family's name.

`ModelConfig` holds what changes the maths: sizes, and the features the supported families add over
Llama (q/k norms, Gemma's norms and embedding scale, per-layer attention type and window, RoPE per
layer type, no-RoPE layers, partial rotary, RoPE scaling, activation, biases, tying). The model,
the quantizers, the pruners, the exporters and the runtimes read these features; only the
checkpoint boundary (a Hugging Face `config.json`, a GGUF's metadata) knows a family's name,
through `FAMILIES`: a new family is a table entry plus tests.

    cfg = ModelConfig.from_hf(json.load(open("config.json")))    # UserError on what we cannot run
    cfg.window_of(i), cfg.rope_of(i)                              # per layer: sliding window, RoPE or None
    cfg.to_hf()                                                   # the family's own config.json again

Norm weights are held as the gain the norm multiplies by: Gemma stores `w` and multiplies by
`1 + w` (`norm_offset = 1.0`), so loading adds the offset and saving subtracts it (as llama.cpp's
converter does); every consumer of a norm weight then sees one convention.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from edgefinfer.errors import UserError

FULL, SLIDING = "full_attention", "sliding_attention"
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SwiGLU, GeGLU with tanh-approximated GELU
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def normalize_eos_ids(eos_token_id: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """A config's `eos_token_id` (one id, a list of them, or None) as a tuple of ids."""
    if eos_token_id is None:
        return ()
    return tuple(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else (eos_token_id,)


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding of one layer type: base, rotated dimensions, scaling.

    `scaling` holds the Hugging Face rope parameters minus `rope_theta` (sorted items, so that a Rope
    is hashable and layers sharing one share their cos/sin tables)."""

    theta: float
    dim: int  # rotated dimensions of each head (head_dim * partial_rotary_factor), even
    scaling: tuple[tuple[str, Any], ...] = ()

    @property
    def kind(self) -> str:
        s = dict(self.scaling)
        return s.get("rope_type", s.get("type", "default"))

    def params(self) -> dict[str, Any]:
        return dict(self.scaling)

    def inv_freq_and_factor(self, max_position_embeddings: int):
        """(inverse frequencies [dim/2] float32, attention factor multiplying cos and sin), as
        transformers' `ROPE_INIT_FUNCTIONS` compute them for this type."""
        import torch

        d, base, p, kind = self.dim, self.theta, self.params(), self.kind
        exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d  # [d/2]
        inv_freq = 1.0 / (base ** exponents)
        if kind == "default":
            return inv_freq, 1.0
        if kind == "linear":
            return inv_freq / p["factor"], 1.0
        if kind == "llama3":  # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend between
            factor = p["factor"]
            low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
            old = p.get("original_max_position_embeddings", 8192)
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
            smooth = (old / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old / high) & (wavelen <= old / low)
            return torch.where(medium, smoothed, scaled), 1.0
        old = p.get("original_max_position_embeddings", max_position_embeddings)
        factor = p.get("factor") or max_position_embeddings / old
        if kind == "yarn":
            return _yarn(d, base, factor, old, p)
        # longrope (Phi-3.5 / Phi-4-mini): per-frequency factors. The short ones, as transformers and
        # llama.cpp use them for contexts up to `original_max_position_embeddings`.
        attention = p.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
        ext = torch.tensor(p["short_factor"], dtype=torch.float32)
        return 1.0 / (ext * base ** exponents), float(attention)


def _yarn(d: int, base: float, factor: float, old: int, p: dict[str, Any]):
    import torch

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    model_type: str = "llama"  # the checkpoint family (FAMILIES); only the HF / GGUF boundary reads it
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
    # ---- features beyond Llama ----
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # the checkpoint stores norm gains minus this (Gemma: 1.0)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too (Gemma 2/3)
    embedding_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    layer_types: tuple[str, ...] | None = None  # per layer FULL / SLIDING; None: all SLIDING iff sliding_window
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3), unscaled
    no_rope_layers: tuple[int, ...] = ()  # layers that apply no RoPE (SmolLM3)
    partial_rotary_factor: float = 1.0  # share of each head's dimensions RoPE rotates (Phi-4-mini: 0.75)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power instead of head_dim's (Gemma)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # unknown HF keys, kept verbatim

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise UserError(f"unsupported model_type {self.model_type!r}: edgefinfer implements {supported_list()}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention needs whole groups)"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise UserError(f"unsupported hidden_act {self.hidden_act!r}: edgefinfer implements "
                            f"{', '.join(ACTIVATIONS)} (gated MLPs)")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise UserError(f"layer_types lists {len(self.layer_types)} layers but num_hidden_layers is "
                                f"{self.num_hidden_layers}; they must agree")
            odd = sorted(set(self.layer_types) - {FULL, SLIDING})
            if odd:
                raise UserError(f"unsupported layer type {odd[0]!r}: edgefinfer implements {FULL} and {SLIDING} "
                                f"attention layers (no linear-attention or convolution layers)")
            if SLIDING in self.layer_types and self.sliding_window is None:
                raise UserError("layer_types has sliding_attention layers but sliding_window is not set")
        if any(not 0 <= i < self.num_hidden_layers for i in self.no_rope_layers):
            raise UserError(f"no_rope_layers {list(self.no_rope_layers)} names layers outside 0.."
                            f"{self.num_hidden_layers - 1}")
        rotary = self.dim_per_head * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or int(rotary) % 2:
            raise UserError(f"partial_rotary_factor {self.partial_rotary_factor} must rotate an even number of "
                            f"the {self.dim_per_head} head dimensions")
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in ROPE_TYPES:
            raise UserError(f"unsupported rope_scaling type {kind!r}: edgefinfer implements {', '.join(ROPE_TYPES)}")

    # ---- per-layer features ----------------------------------------------------------------------
    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.dim_per_head * self.partial_rotary_factor)

    def layer_type(self, layer: int) -> str:
        if self.layer_types is not None:
            return self.layer_types[layer]
        return SLIDING if self.sliding_window is not None else FULL

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer` (the query sees itself and window - 1 earlier positions), or None."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else None

    @property
    def uniform_window(self) -> int | None:
        """The window every layer has, or None when some layer attends to everything (a cache may then
        drop what lies behind this window for all layers at once)."""
        windows = {self.window_of(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def has_global_layers(self) -> bool:
        return any(self.window_of(i) is None for i in range(self.num_hidden_layers))

    def rope_of(self, layer: int) -> Rope | None:
        """The RoPE `layer` applies, or None for a no-RoPE layer (SmolLM3)."""
        if layer in self.no_rope_layers:
            return None
        if self.rope_local_theta is not None and self.layer_type(layer) == SLIDING:
            return Rope(float(self.rope_local_theta), self.rotary_dim)
        scaling = {k: v for k, v in (self.rope_scaling or {}).items() if k not in ("rope_theta", "type")}
        if scaling.get("rope_type", "default") == "default":
            scaling = {}
        return Rope(float(self.rope_theta), self.rotary_dim, tuple(sorted((k, _hashable(v)) for k, v in scaling.items())))

    def ropes(self) -> list[Rope]:
        """The distinct RoPEs of the model, in first-use order (one cos/sin table each)."""
        out: list[Rope] = []
        for i in range(self.num_hidden_layers):
            rope = self.rope_of(i)
            if rope is not None and rope not in out:
                out.append(rope)
        return out

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.dim_per_head) ** -0.5

    @property
    def eos_token_ids(self) -> list[int]:
        return list(normalize_eos_ids(self.eos_token_id))

    @property
    def family(self) -> "Family":
        return FAMILIES[self.model_type]

    @property
    def architecture(self) -> str:
        return self.family.architecture

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def keep_layers(self, keep: list[int]) -> "ModelConfig":
        """The config of a model made of the layers `keep` (in order), per-layer features following them."""
        index = {old: new for new, old in enumerate(keep)}
        return self.replace(
            num_hidden_layers=len(keep),
            layer_types=None if self.layer_types is None else tuple(self.layer_types[i] for i in keep),
            no_rope_layers=tuple(index[i] for i in self.no_rope_layers if i in index))

    def num_parameters(self) -> int:
        """Parameter count implied by the config (tied embeddings counted once)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.dim_per_head
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        attn = d * q + 2 * d * kv + q * d
        attn += (q + 2 * kv) * self.qkv_bias + d * self.o_bias + 2 * hd * self.qk_norm
        mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
        per_layer = attn + mlp + (4 if self.sandwich_norms else 2) * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + d

    # ---- Hugging Face config.json ------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        family = family_of_hf(hf)
        try:
            return family.read(hf)
        except KeyError as e:
            raise UserError(f"config.json lacks the required key {e.args[0]!r} for {family.architecture}") from None

    def to_hf(self) -> dict[str, Any]:
        hf: dict[str, Any] = dict(self.extra)
        hf.update(self.family.write(self))
        return hf


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


# ---- the families -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    """One checkpoint family: its Hugging Face names, llama.cpp's architecture name and how its
    config.json maps onto features (`read`) and back (`write`)."""

    name: str  # our model_type, HF's `model_type`
    architecture: str  # HF `architectures[0]`
    gguf_arch: str  # llama.cpp's `general.architecture`
    read: Callable[[dict[str, Any]], ModelConfig]
    write: Callable[[ModelConfig], dict[str, Any]]
    fused_qkv: bool = False  # the checkpoint packs q|k|v into one matrix (Phi-3)
    fused_gate_up: bool = False  # ... and gate|up into one (Phi-3)


def _rope(hf: dict[str, Any], key: str | None = None) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling or None, partial rotary factor) from a 4.x (`rope_theta`, `rope_scaling`) or
    5.x (`rope_parameters`, per layer type for Gemma 3) config."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and key is not None and isinstance(params.get(key), dict):
        params = params[key]
    theta, scaling = hf.get("rope_theta"), hf.get("rope_scaling")
    partial = hf.get("partial_rotary_factor", 1.0)
    if isinstance(params, dict) and "rope_theta" in params or isinstance(params, dict) and "rope_type" in params:
        theta = params.get("rope_theta", theta)
        partial = params.get("partial_rotary_factor", partial)
        rest = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
        scaling = rest if rest.get("rope_type", "default") != "default" else None
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind in ("su", "longrope"):
            kind = "longrope"
        scaling.pop("type", None)
        scaling["rope_type"] = kind
        if kind == "default":
            scaling = None
        elif kind in ("longrope", "yarn") and "original_max_position_embeddings" not in scaling \
                and "original_max_position_embeddings" in hf:
            scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    return float(theta if theta is not None else 10000.0), scaling, float(partial if partial is not None else 1.0)


_KNOWN = {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
          "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
          "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "bos_token_id",
          "eos_token_id", "pad_token_id", "hidden_act", "hidden_activation", "torch_dtype", "dtype",
          "query_pre_attn_scalar", "rope_local_base_freq", "no_rope_layers", "no_rope_layer_interval",
          "partial_rotary_factor", "original_max_position_embeddings", "sliding_window_pattern",
          "final_logit_softcapping", "attn_logit_softcapping", "use_cache", "use_bidirectional_attention"}


def _common(hf: dict[str, Any], model_type: str, **features: Any) -> ModelConfig:
    theta = features.pop("rope_theta", None)
    scaling = features.pop("rope_scaling", None)
    partial = features.pop("partial_rotary_factor", None)
    if theta is None:
        theta, scaling, partial = _rope(hf)
    base = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        model_type=model_type,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6 if model_type != "llama" else 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial if partial is not None else 1.0,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        hidden_act=hf.get("hidden_act") or hf.get("hidden_activation") or "silu",
        torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        extra={k: v for k, v in hf.items() if k not in _KNOWN},
    )
    base.update(features)
    if base["head_dim"] is not None and base["head_dim"] * base["num_attention_heads"] == base["hidden_size"] \
            and model_type in ("llama", "mistral", "qwen2", "phi3", "smollm3"):
        base["head_dim"] = None  # the derived value: keep configs comparing equal however they were written
    return ModelConfig(**base)


def _layer_types(hf: dict[str, Any], default: list[str] | None) -> tuple[str, ...] | None:
    types = hf.get("layer_types") or default
    return None if types is None else tuple(types)


def _base_hf(c: ModelConfig) -> dict[str, Any]:
    hf = dict(
        architectures=[c.architecture], model_type=c.model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.dim_per_head, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        hidden_act=c.hidden_act, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id, torch_dtype=c.torch_dtype, use_cache=True)
    if c.partial_rotary_factor != 1.0:
        hf["partial_rotary_factor"] = c.partial_rotary_factor
    return hf


def _explicit_layer_types(c: ModelConfig) -> list[str]:
    return [c.layer_type(i) for i in range(c.num_hidden_layers)]


def _refuse_features(c: ModelConfig, family: str, **allowed: bool) -> None:
    """A family's config.json cannot express a feature it does not have: refuse, naming it."""
    present = {"qk_norm": c.qk_norm, "sandwich_norms": c.sandwich_norms, "norm_offset": c.norm_offset != 0,
               "embedding_scale": c.embedding_scale is not None, "no_rope_layers": bool(c.no_rope_layers),
               "rope_local_theta": c.rope_local_theta is not None,
               "query_pre_attn_scalar": c.query_pre_attn_scalar is not None,
               "gelu": c.hidden_act != "silu", "partial_rotary": c.partial_rotary_factor != 1.0}
    bad = [k for k, on in present.items() if on and not allowed.get(k, False)]
    if bad:
        raise UserError(f"a {family} checkpoint cannot express {', '.join(bad)}; save this model as a family "
                        f"that has them")


# llama: Llama 1-3.x (llama3 / linear / yarn RoPE scaling), attention and MLP biases optional.
def _read_llama(hf: dict[str, Any]) -> ModelConfig:
    bias = bool(hf.get("attention_bias", False))
    return _common(hf, "llama", qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))


def _write_llama(c: ModelConfig) -> dict[str, Any]:
    _refuse_features(c, "Llama")
    if c.qkv_bias != c.o_bias:
        raise UserError("a Llama checkpoint has either biases on all of q/k/v/o or on none")
    if c.layer_types is not None and SLIDING in c.layer_types or c.sliding_window is not None:
        raise UserError("a Llama checkpoint has no sliding window; save it as mistral or qwen2")
    return {**_base_hf(c), "attention_bias": c.qkv_bias, "mlp_bias": c.mlp_bias}


def _read_mistral(hf: dict[str, Any]) -> ModelConfig:
    window = hf.get("sliding_window")
    return _common(hf, "mistral", sliding_window=window)


def _write_mistral(c: ModelConfig) -> dict[str, Any]:
    _refuse_features(c, "Mistral")
    if c.layer_types is not None and len(set(c.layer_types)) > 1:
        raise UserError("a Mistral checkpoint has one window for every layer; interleaved layers need qwen2 or gemma3")
    return {**_base_hf(c), "sliding_window": c.uniform_window}


def _qwen_layer_types(hf: dict[str, Any]) -> tuple[tuple[str, ...] | None, int | None]:
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    n = hf["num_hidden_layers"]
    default = None
    if window is not None:  # transformers' rule: layers from max_window_layers on slide
        first = hf.get("max_window_layers", 28)
        default = [SLIDING if i >= first else FULL for i in range(n)]
    types = _layer_types(hf, default)
    if types is not None and SLIDING not in types:
        return None, None
    if types is not None and window is None:
        window = hf.get("sliding_window")
    return types, window


def _read_qwen2(hf: dict[str, Any]) -> ModelConfig:
    types, window = _qwen_layer_types(hf)
    return _common(hf, "qwen2", qkv_bias=True, layer_types=types, sliding_window=window)


def _read_qwen3(hf: dict[str, Any]) -> ModelConfig:
    types, window = _qwen_layer_types(hf)
    bias = bool(hf.get("attention_bias", False))
    return _common(hf, "qwen3", qkv_bias=bias, o_bias=bias, qk_norm=True, layer_types=types, sliding_window=window)


def _write_qwen(c: ModelConfig, family: str) -> dict[str, Any]:
    hf = _base_hf(c)
    types = _explicit_layer_types(c)
    sliding = [i for i, t in enumerate(types) if t == SLIDING]
    if sliding and sliding != list(range(sliding[0], c.num_hidden_layers)):
        raise UserError(f"a {family} checkpoint slides a suffix of its layers; this model interleaves them")
    hf.update(use_sliding_window=bool(sliding), sliding_window=c.sliding_window,
              max_window_layers=sliding[0] if sliding else c.num_hidden_layers, layer_types=types)
    return hf


def _write_qwen2(c: ModelConfig) -> dict[str, Any]:
    _refuse_features(c, "Qwen2")
    if not c.qkv_bias or c.o_bias or c.mlp_bias:
        raise UserError("a Qwen2 checkpoint has biases on q/k/v and nowhere else")
    return _write_qwen(c, "Qwen2")


def _write_qwen3(c: ModelConfig) -> dict[str, Any]:
    _refuse_features(c, "Qwen3", qk_norm=True)
    if not c.qk_norm or c.qkv_bias != c.o_bias or c.mlp_bias:
        raise UserError("a Qwen3 checkpoint has q/k norms, and biases on all of q/k/v/o or none")
    return {**_write_qwen(c, "Qwen3"), "attention_bias": c.qkv_bias}


def _read_gemma3(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
        raise UserError("logit soft-capping (Gemma 2) is not supported; edgefinfer implements Gemma 3")
    if hf.get("use_bidirectional_attention"):
        raise UserError("bidirectional attention (EmbeddingGemma) is not supported: edgefinfer runs decoders")
    n = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", 6)
    default = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    theta, scaling, partial = _rope(hf, FULL)
    local_theta, _, _ = _rope({"rope_theta": hf.get("rope_local_base_freq", 10000.0),
                               "rope_parameters": hf.get("rope_parameters")}, SLIDING)
    if theta == 10000.0 and "rope_theta" not in hf and not isinstance(hf.get("rope_parameters"), dict):
        theta = 1_000_000.0  # Gemma 3's default global base
    hidden = hf["hidden_size"]
    return _common(hf, "gemma3_text", rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial,
                   rope_local_theta=local_theta, layer_types=_layer_types(hf, default),
                   sliding_window=hf.get("sliding_window", 4096), qk_norm=True, norm_offset=1.0,
                   sandwich_norms=True, embedding_scale=hidden ** 0.5,
                   query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
                   hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
                   head_dim=hf.get("head_dim", 256), tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                   qkv_bias=bool(hf.get("attention_bias", False)), o_bias=bool(hf.get("attention_bias", False)))


def _heads_divide(c: ModelConfig, family: str) -> None:
    if c.hidden_size % c.num_attention_heads:
        raise UserError(f"transformers' {family} config requires hidden_size ({c.hidden_size}) to be a multiple of "
                        f"num_attention_heads ({c.num_attention_heads}); keep more heads when pruning this model")


def _write_gemma3(c: ModelConfig) -> dict[str, Any]:
    _heads_divide(c, "Gemma 3")
    _refuse_features(c, "Gemma 3", qk_norm=True, sandwich_norms=True, norm_offset=True, embedding_scale=True,
                     rope_local_theta=True, query_pre_attn_scalar=True, gelu=True)
    if not (c.qk_norm and c.sandwich_norms and c.norm_offset == 1.0 and c.embedding_scale is not None):
        raise UserError("a Gemma 3 checkpoint has q/k norms, sandwich norms with (1 + w) gains and a scaled embedding")
    if abs(c.embedding_scale - c.hidden_size ** 0.5) > 1e-6 * c.embedding_scale:
        raise UserError("a Gemma 3 checkpoint scales embeddings by sqrt(hidden_size) only")
    hf = _base_hf(c)
    hf.pop("hidden_act")
    full = {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}
    local = c.rope_local_theta if c.rope_local_theta is not None else c.rope_theta
    hf.pop("rope_scaling")
    hf.update(hidden_activation=c.hidden_act, query_pre_attn_scalar=c.query_pre_attn_scalar,
              sliding_window=c.sliding_window, layer_types=_explicit_layer_types(c), rope_local_base_freq=local,
              rope_parameters={FULL: full, SLIDING: {"rope_type": "default", "rope_theta": local}},
              attention_bias=c.qkv_bias, final_logit_softcapping=None, attn_logit_softcapping=None)
    return hf


def _read_phi3(hf: dict[str, Any]) -> ModelConfig:
    window = hf.get("sliding_window")
    return _common(hf, "phi3", sliding_window=window)


def _write_phi3(c: ModelConfig) -> dict[str, Any]:
    _refuse_features(c, "Phi-3", partial_rotary=True)
    _heads_divide(c, "Phi-3")
    if c.dim_per_head * c.num_attention_heads != c.hidden_size:
        raise UserError("a Phi-3 checkpoint derives head_dim from hidden_size / num_attention_heads; this model's "
                        f"head_dim {c.dim_per_head} differs")
    if c.qkv_bias or c.o_bias or c.mlp_bias:
        raise UserError("a Phi-3 checkpoint has no biases")
    hf = _base_hf(c)
    scaling = dict(c.rope_scaling or {})
    if "original_max_position_embeddings" in scaling:
        hf["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    hf.update(sliding_window=c.uniform_window)
    return hf


def _read_smollm3(hf: dict[str, Any]) -> ModelConfig:
    n = hf["num_hidden_layers"]
    interval = hf.get("no_rope_layer_interval", 4)
    flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    types = _layer_types(hf, None) if window is not None else None
    bias = bool(hf.get("attention_bias", False))
    return _common(hf, "smollm3", no_rope_layers=tuple(i for i, f in enumerate(flags) if not f),
                   sliding_window=window, layer_types=types, qkv_bias=bias, o_bias=bias,
                   mlp_bias=bool(hf.get("mlp_bias", False)))


def _write_smollm3(c: ModelConfig) -> dict[str, Any]:
    _refuse_features(c, "SmolLM3", no_rope_layers=True)
    hf = _base_hf(c)
    hf.update(no_rope_layers=[0 if i in c.no_rope_layers else 1 for i in range(c.num_hidden_layers)],
              use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window,
              layer_types=_explicit_layer_types(c), attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias)
    return hf


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM", "llama", _read_llama, _write_llama),
    Family("mistral", "MistralForCausalLM", "llama", _read_mistral, _write_mistral),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", _read_qwen2, _write_qwen2),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", _read_qwen3, _write_qwen3),
    Family("gemma3_text", "Gemma3ForCausalLM", "gemma3", _read_gemma3, _write_gemma3),
    Family("phi3", "Phi3ForCausalLM", "phi3", _read_phi3, _write_phi3, fused_qkv=True, fused_gate_up=True),
    Family("smollm3", "SmolLM3ForCausalLM", "smollm3", _read_smollm3, _write_smollm3),
)}
_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}
# What a user may bring that is not a text decoder we run, with the reason in one phrase.
_REFUSED = {
    "Gemma3ForConditionalGeneration": "a vision-language model (Gemma 3 with a vision tower); export its text "
                                      "decoder as Gemma3ForCausalLM",
    "Gemma3nForConditionalGeneration": "Gemma 3n (per-layer embeddings, AltUp, a vision/audio tower)",
    "Gemma3nForCausalLM": "Gemma 3n (per-layer embeddings, AltUp)",
    "Lfm2ForCausalLM": "LFM2 (hybrid convolution layers)",
    "Qwen3NextForCausalLM": "Qwen3-Next (hybrid linear-attention layers)",
    "Qwen3_5ForCausalLM": "Qwen3.5 (hybrid linear-attention layers)",
    "Qwen3MoeForCausalLM": "a mixture-of-experts model",
    "MixtralForCausalLM": "a mixture-of-experts model",
    "Gemma2ForCausalLM": "Gemma 2 (logit soft-capping)",
}


def supported_list() -> str:
    return ", ".join(f"{f.architecture} ({f.name})" for f in FAMILIES.values())


def family_of_hf(hf: dict[str, Any]) -> Family:
    arch = (hf.get("architectures") or [None])[0]
    model_type = hf.get("model_type")
    if arch in _REFUSED:
        raise UserError(f"unsupported architecture {arch}: {_REFUSED[arch]}; edgefinfer implements {supported_list()}")
    family = _BY_ARCHITECTURE.get(arch or "") or (FAMILIES.get(model_type or "") if arch is None else None)
    if family is None or (model_type is not None and model_type != family.name):
        raise UserError(f"unsupported architecture {arch or model_type!r}: edgefinfer implements {supported_list()}")
    if hf.get("vision_config") or hf.get("text_config"):
        raise UserError(f"{arch}: a multimodal config (vision tower); edgefinfer implements text decoders: "
                        f"{supported_list()}")
    return family


def family_of_gguf(arch: str) -> list[Family]:
    """The families whose GGUF architecture is `arch` (llama covers Llama and Mistral)."""
    return [f for f in FAMILIES.values() if f.gguf_arch == arch]
