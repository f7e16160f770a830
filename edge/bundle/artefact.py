"""The typed description of an exported artefact: what an exporter writes and a runtime reads.

An exporter fills an `ArtefactSpec` (format, recipe, KV cache, sizes, I/O names) and `write_spec`
renders it for one carrier; the runtime gets it back with `read_spec`:

    "onnx"      an ONNX model's metadata_props (`edgefinfer.*` string keys)
    "pte"       an ExecuTorch program's constant methods (the keys ExecuTorch's LLM runners read,
                plus ours, `edgefinfer_*`)
    "manifest"  the part of a bundle manifest entry's `meta` that describes the artefact

Every key lives in this module only, so the side that writes and the side that reads cannot drift
apart. GGUF files describe themselves with llama.cpp's standard keys and need none of ours.

This is foundation: it imports neither an exporter (a phone has none) nor a runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping

from edgefinfer.errors import UserChoice, UserError

if TYPE_CHECKING:  # the recipe grammar and the model config are imported where used: `run` needs neither
    from edgefinfer.bundle.quant_recipe import QuantRecipe

Carrier = Literal["onnx", "pte", "manifest"]


class Layout(UserChoice):
    """An exported KV cache's layout, the one type for every exporter, the build and the runtime.
    static: one slot per position up to a maximum; window: a buffer that keeps the last positions and
    streams without a length limit. A StrEnum, so that it is written (JSON, metadata) as its name."""

    STATIC = "static"
    WINDOW = "window"

    @classmethod
    def refusal(cls, text: object) -> str:
        return f"unknown kv layout {text!r}: use 'static' or 'window'"


LAYOUTS: tuple[str, ...] = tuple(Layout)

# Artefact formats (a manifest entry's `format`) and the ONNX graph kind that tells the ONNX ones apart.
ONNX_GRAPHS = {"onnx": "gqa", "onnx-static": "static-decode"}
ONNX_PREFIX = "edgefinfer."
PTE_FORMAT_VERSION = 1
UNBOUNDED_CONTEXT = 1 << 30  # the context a window cache reports to ExecuTorch's runners (it has none)


@dataclass(frozen=True)
class KVSpec:
    """An artefact's KV cache, fixed when it is exported.

    static: one slot per position up to `max_seq_len`. window: a buffer that keeps the last `window`
    positions (and `sinks` first ones) and streams without a length limit; its `lookahead` spare
    slots keep a multi-token step or a rollback exact.
    """

    layout: Layout = Layout.STATIC
    max_seq_len: int | None = None  # positions addressed: the static cache's, or a ring graph's RoPE table
    window: int | None = None  # keys a query sees, itself included (None: the whole context)
    sinks: int | None = None  # attention-sink slots (None: the format keeps none)
    lookahead: int | None = None  # window: spare slots beyond the window
    slots: int | None = None  # KV slots per layer where they are not max_seq_len (window buffers, rings)
    max_chunk: int | None = None  # tokens one call takes (None: any number)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", Layout.parse(self.layout))  # a caller's "window" is the layout

    @property
    def streams(self) -> bool:
        """A window cache: the stream has no length limit."""
        return self.layout is Layout.WINDOW

    def describe(self) -> str:
        """How a one-line error names this cache."""
        if not self.streams:
            return "a static cache"
        return f"a window cache of {self.window} (sinks {self.sinks or 0})"


@dataclass(frozen=True)
class ArtefactSpec:
    """One exported artefact: what a runtime needs to know to drive it, and what the manifest records."""

    format: str  # pte | onnx | onnx-static | qnn-context | gguf
    kv: KVSpec = KVSpec()
    recipe_name: str | None = None  # as the build named it: int4-g32-sym-emb4, 8da4w-g32, fp32, qdq-a16w8, ...
    vocab_size: int | None = None
    num_layers: int | None = None
    all_logits: bool | None = None  # every new position's logits (None: the format always returns them)
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)  # what else a manifest entry records

    @property
    def recipe(self) -> QuantRecipe | None:
        """The recipe as a `QuantRecipe`; None for float weights and for recipes outside the
        quantizer's grammar (QDQ activation schemes, llama.cpp's own quantizer, mixed labels)."""
        from edgefinfer.bundle.recipe import quant_recipe_of

        return quant_recipe_of(self.recipe_name)


def write_spec(spec: ArtefactSpec, carrier: Carrier) -> dict[str, Any]:
    """`spec` as `carrier` stores it (see the module docstring); `read_spec` reverses it."""
    return {"onnx": _onnx_metadata, "pte": _pte_methods, "manifest": _manifest_meta}[carrier](spec)


def read_spec(carrier: Carrier, stored: Mapping[str, Any]) -> ArtefactSpec:
    """The `ArtefactSpec` that `write_spec` stored in `stored`. Absent keys read as unknown (None), so
    an ONNX model from another exporter (onnxruntime-genai's builder) reads as a plain GQA decoder."""
    return {"onnx": _from_onnx, "pte": _from_pte, "manifest": _from_manifest}[carrier](stored)


# ---- ONNX metadata_props: "edgefinfer.<key>" -> str --------------------------------------------------------

def _onnx_metadata(spec: ArtefactSpec) -> dict[str, str]:
    kv = spec.kv
    fields = {"graph": ONNX_GRAPHS[spec.format], "kv": kv.layout, "max_seq_len": kv.max_seq_len,
              "window": kv.window, "cache_slots": kv.slots, "chunk": kv.max_chunk, "weights": spec.recipe_name,
              "vocab_size": spec.vocab_size, "num_layers": spec.num_layers}
    return {ONNX_PREFIX + k: str(v) for k, v in fields.items() if v is not None}


def _from_onnx(meta: Mapping[str, str]) -> ArtefactSpec:
    def get(key: str) -> str | None:
        return meta.get(ONNX_PREFIX + key) or None  # older exports wrote "" for unset

    def number(key: str) -> int | None:
        value = get(key)
        return None if value is None else int(value)

    graph = get("graph") or ONNX_GRAPHS["onnx"]
    formats = {g: f for f, g in ONNX_GRAPHS.items()}
    if graph not in formats:
        raise UserError(f"unknown edgefinfer ONNX graph kind {graph!r} (this edgefinfer knows "
                        f"{', '.join(formats)}); re-export the model")
    # The static decode graph is a ring whatever its metadata says (older exports wrote no layout).
    layout = Layout.WINDOW if graph == ONNX_GRAPHS["onnx-static"] else Layout.parse(get("kv") or Layout.STATIC)
    window, slots = number("window"), number("cache_slots")
    # GQA's window buffer is the window plus its lookahead; the ring graph's slots are the window itself.
    lookahead = (slots - window if graph == ONNX_GRAPHS["onnx"] and layout is Layout.WINDOW and slots and window
                 else None)
    kv = KVSpec(layout, max_seq_len=number("max_seq_len"), window=window, slots=slots, max_chunk=number("chunk"),
                 lookahead=lookahead)
    return ArtefactSpec(formats[graph], kv, recipe_name=get("weights"), vocab_size=number("vocab_size"),
                        num_layers=number("num_layers"))


# ---- ExecuTorch constant methods -------------------------------------------------------------------------

def _pte_methods(spec: ArtefactSpec) -> dict[str, Any]:
    kv = spec.kv
    return {
        # ExecuTorch's LLM runners: max tokens per forward, and positions the cache addresses.
        "get_max_seq_len": kv.max_chunk,
        "get_max_context_len": UNBOUNDED_CONTEXT if kv.streams else kv.max_seq_len,
        "get_vocab_size": spec.vocab_size,
        "get_n_layers": spec.num_layers,
        "get_bos_id": -1 if spec.bos_id is None else spec.bos_id,
        "get_eos_ids": list(spec.eos_ids),
        "use_kv_cache": True,
        "enable_dynamic_shape": kv.max_chunk > 1,
        "use_sdpa_with_kv_cache": False,
        # Ours: what ExecuTorchBackend needs to drive the cache (0 = none: a method returns a value).
        "edgefinfer_window": kv.window or 0,
        "edgefinfer_num_sinks": kv.sinks or 0,
        "edgefinfer_lookahead": kv.lookahead or 0,
        "edgefinfer_all_logits": bool(spec.all_logits),
        "edgefinfer_format_version": PTE_FORMAT_VERSION,
    }


# The program's KV cache buffers by name (ExecuTorch's `Method.get_attribute`, which the exporter enables
# with `emit_mutable_buffer_names`): the exported module keeps its cache as `cache`, one key and one value
# buffer per layer ([1, slots, Hkv, D]); a ring also keeps each slot's position (`slot_pos`, -1 = empty).
PTE_SLOT_POSITIONS = "cache.slot_pos"


def pte_kv_buffers(num_layers: int) -> list[str]:
    """The names of a .pte's per-layer K and V buffers, layer by layer (k_0, v_0, k_1, ...)."""
    return [f"cache.{kind}_{layer}" for layer in range(num_layers) for kind in ("k", "v")]


def _from_pte(methods: Mapping[str, Any]) -> ArtefactSpec:
    from edgefinfer.model.config import normalize_eos_ids

    window = int(methods.get("edgefinfer_window", 0)) or None
    max_chunk = int(methods["get_max_seq_len"])
    kv = KVSpec(Layout.WINDOW if window else Layout.STATIC,
                 max_seq_len=None if window else int(methods.get("get_max_context_len", max_chunk)),
                 window=window, sinks=int(methods.get("edgefinfer_num_sinks", 0)),
                 lookahead=int(methods.get("edgefinfer_lookahead", 0)) or None, max_chunk=max_chunk)
    eos = methods.get("get_eos_ids", [])
    bos = int(methods.get("get_bos_id", -1))
    return ArtefactSpec("pte", kv, vocab_size=int(methods["get_vocab_size"]),
                        num_layers=int(methods["get_n_layers"]) if "get_n_layers" in methods else None,
                        all_logits=bool(methods.get("edgefinfer_all_logits", False)), bos_id=bos if bos >= 0 else None,
                        eos_ids=tuple(int(e) for e in normalize_eos_ids(eos)))


# ---- the bundle manifest ---------------------------------------------------------------------------------

def _manifest_meta(spec: ArtefactSpec) -> dict[str, Any]:
    kv = spec.kv
    # max_chunk and num_sinks only where the format has them, so each entry says what its artefact holds.
    cache = {"layout": kv.layout, "max_seq_len": kv.max_seq_len,
             **({"max_chunk": kv.max_chunk} if kv.max_chunk is not None else {}), "window": kv.window,
             **({"num_sinks": kv.sinks} if kv.sinks is not None else {}), "lookahead": kv.lookahead}
    return {"format": spec.format, "recipe": spec.recipe_name, "kv": cache, "inputs": list(spec.inputs),
            "outputs": list(spec.outputs)}


def _from_manifest(meta: Mapping[str, Any]) -> ArtefactSpec:
    """`meta`: a manifest entry's meta with the entry's own `format` and `recipe` fields merged in."""
    cache = meta.get("kv") if isinstance(meta.get("kv"), dict) else {}
    try:
        kv = KVSpec(cache.get("layout", Layout.STATIC), max_seq_len=cache.get("max_seq_len"), window=cache.get("window"),
                     sinks=cache.get("num_sinks"), lookahead=cache.get("lookahead"), max_chunk=cache.get("max_chunk"))
    except UserError as e:
        raise UserError(f"the manifest's kv entry is malformed ({e}); rebuild the bundle") from None
    return ArtefactSpec(str(meta.get("format", "")), kv, recipe_name=meta.get("recipe"), inputs=tuple(meta.get("inputs", ())),
                        outputs=tuple(meta.get("outputs", ())), metadata=dict(meta))
