"""ONNX Runtime backends: the fused GQA decoder (`OrtBackend`) and the static decode graph
(`OrtStaticBackend`, the Qualcomm QNN / NPU form). Both implement `Backend`.

Nothing here imports the exporter (a phone has none): what a backend needs to know is read from
the graph's inputs and its metadata (`edgefinfer.bundle.artefact.read_spec`).

OrtBackend keeps each layer's keys and values in one ONNX Runtime tensor of `max_seq_len` slots,
bound through IO binding as both `past_key_values.i.*` and `present.i.*`; GroupQueryAttention then
writes the new entries into that same buffer (past/present buffer sharing), so a step copies
nothing but the token ids in and the logits out. Positions are implicit: the `attention_mask`
length is start_pos + S and new entries land at slots start_pos.., so a rollback is a no-op: the
next call simply starts at the shorter length and overwrites the stale slots.

A window graph (`export_onnx(kv="window")`) binds buffers of `window + lookahead` slots instead and
feeds `position_ids`; GQA evicts inside them, so the stream has no length limit and memory stays
flat. `ort_window.WindowedKV` mirrors the operator's layout so rollbacks stay exact.

OrtStaticBackend runs a graph whose every shape is fixed (batch 1, one token, a W-slot window
cache): the host owns the cache as numpy arrays, passes it in, receives the new token's key/value
and writes them into ring slot `pos % W`, and builds the finite additive mask. Prefill is token by
token (that is all such a graph can do).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from edgefinfer.bundle.artefact import read_spec
from edgefinfer.errors import UserError
from edgefinfer.libraries.cpus import affinity_cap
from edgefinfer.libraries.ort_ep import import_ort as _import_ort
from edgefinfer.libraries.ort_ep import qnn_context_session
from edgefinfer.runtime.backends.base import UNBOUNDED
from edgefinfer.runtime.backends.ort_window import WindowedKV

MODEL_FILE = "model.onnx"
GRAPH_READ_S = 0.04  # see OrtBackend: when the session has released the GIL
MASK_OFF = -100.0  # the static graph's "may not attend" bias: finite, so int8/int16 QDQ keeps resolution

_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32}


def resolve_model_path(path: str | Path, filename: str = MODEL_FILE) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / filename
    if not p.is_file():
        raise UserError(f"no ONNX model at {p}: export one with `edgefinfer build --target linux-x86_64` "
                        "or pass the folder that holds model.onnx")
    return p


def _call_once(fn: Callable[[], None]) -> Callable[[], None]:
    """`fn`, run by whichever thread calls first; later calls do nothing."""
    lock, done = threading.Lock(), []

    def call() -> None:
        with lock:
            if not done:
                done.append(True)
                fn()
    return call


def session_options(threads: int | None):
    ort = _import_ort()
    so = ort.SessionOptions()
    # 0: ONNX Runtime's default, one per physical core of the host, even under a cpuset (`affinity_cap`).
    so.intra_op_num_threads = threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or affinity_cap() or 0
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return so


# ---- Qualcomm QNN (the onnxruntime-qnn plugin EP; its session helpers are in edgefinfer.libraries.ort_ep) ----

QNN_EPS = ("auto", "qnn", "cpu")


def open_qnn(folder: str | Path, meta: dict[str, Any], ep: str | None = None, threads: int | None = None
             ) -> "OrtStaticBackend":
    """A `--target qnn` bundle's graphs (named in its manifest entry `meta`) as one backend.

    ep: "qnn": the context binaries on the QNN HTP (on a PC, onnxruntime-qnn's x86 emulator);
        "cpu": the same QDQ graphs on ONNX Runtime's CPU EP; "auto" (default, or $EDGEFINFER_QNN_EP):
        qnn where onnxruntime-qnn is installed, else cpu.
    """
    import importlib.util

    folder = Path(folder)
    ep = ep or os.environ.get("EDGEFINFER_QNN_EP") or "auto"
    if ep not in QNN_EPS:
        raise UserError(f"unknown QNN execution provider {ep!r}: use one of {', '.join(QNN_EPS)}")
    if ep == "auto":
        ep = "qnn" if importlib.util.find_spec("onnxruntime_qnn") is not None else "cpu"
    keys = ("context_model", "prompt_context_model") if ep == "qnn" else ("qdq_model", "prompt_qdq_model")
    generator, prompt = (meta.get(k) for k in keys)
    if not generator:
        raise UserError(f"the QNN bundle at {folder} names no {keys[0]} in its manifest; rebuild it")
    sink = load_sink(folder, meta.get("sink_kv"))
    if ep == "cpu":
        return OrtStaticBackend(folder / generator, threads=threads, prefill=folder / prompt if prompt else None,
                                sink=sink)

    def session(name: str):
        return qnn_context_session(folder / name, int(meta["htp_arch"]), int(meta["soc_model"]))

    return OrtStaticBackend(folder / generator, session=session(generator), prefill=folder / prompt if prompt else None,
                            prefill_session=session(prompt) if prompt else None, sink=sink)


def load_sink(folder: Path, name: str | None) -> np.ndarray | None:
    """A bundle's attention-sink file (`np.save`d float keys and values), or None if it names none."""
    if name is None:
        return None
    path = folder / str(name)
    if Path(str(name)).name != str(name) or not path.is_file():
        raise UserError(f"the QNN bundle at {folder} names the attention sink {name!r}, which is not a file "
                        "in the bundle; rebuild it")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"{path} is not a readable attention sink ({str(e).splitlines()[0][:120]}); rebuild "
                        "the bundle") from None


def _genai_decoder(model_path: Path) -> dict[str, Any]:
    """Sizes from an onnxruntime-genai `genai_config.json` beside the model ({} if there is none)."""
    file = model_path.parent / "genai_config.json"
    if not file.is_file():
        return {}
    model = json.loads(file.read_text()).get("model", {})
    return {**model.get("decoder", {}), "context_length": model.get("context_length", 2048)}


class OrtBackend:
    """The exported GQA decoder on ONNX Runtime (CPU by default), one sequence."""

    name = "onnxruntime"
    prefill_grid = 1  # any chunking gives the same rows; one-token steps round differently (tests/test_sessions.py)

    def __init__(self, onnx_dir_or_path: str | Path, providers: Sequence[Any] | None = None,
                 threads: int | None = None, session: Any | None = None, max_seq_len: int | None = None,
                 native_load: Callable[[], None] | None = None):
        """max_seq_len: KV slots to allocate (default and upper bound: what the model was exported for).
        native_load: called once while ONNX Runtime builds the session without the GIL (engine.open_backend)."""
        ort = _import_ort()
        self.path = resolve_model_path(onnx_dir_or_path)
        if session is None:
            options = session_options(threads)
            if native_load is not None:
                # The session holds the GIL while it reads the graph (~13 ms for SmolLM2's), then builds
                # without it (prepacking the weights: ~0.3 s). A parse that took the GIL first would hold
                # the build back until it ended (0.41-0.44 s for both, against 0.30 s for the build alone),
                # so the signal comes once the read is likely over (or when the build ends, if sooner).
                native_load = _call_once(native_load)
                threading.Timer(GRAPH_READ_S, native_load).start()
            providers = list(providers or ["CPUExecutionProvider"])
            session = ort.InferenceSession(str(self.path), options, providers=providers)
            if native_load is not None:
                native_load()
        self.session = session
        self.artefact = spec = read_spec("onnx", self.session.get_modelmeta().custom_metadata_map)
        if spec.format != "onnx":
            raise UserError(f"{self.path} is a {spec.format!r} graph; run it with OrtStaticBackend")
        past = [i for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        if not past:
            raise UserError(f"{self.path} has no past_key_values inputs: it is not a decoder with a KV cache")
        self.n_layers = len(past) // 2
        _, n_kv, _, head_dim = past[0].shape
        self.kv_dtype = _ORT_TYPES[past[0].type]
        logits = next(o for o in self.session.get_outputs() if o.name == "logits")
        genai = _genai_decoder(self.path)  # a model-builder folder names its sizes only there
        self.vocab_size = spec.vocab_size or int(logits.shape[-1])
        self.window = spec.kv.window
        n_kv = n_kv if isinstance(n_kv, int) else genai["num_key_value_heads"]
        head_dim = head_dim if isinstance(head_dim, int) else genai["head_size"]
        if spec.kv.streams:
            slots = spec.kv.slots
            self.max_seq_len = UNBOUNDED  # GQA evicts inside `slots`; positions have no table to outgrow
        else:
            exported = spec.kv.max_seq_len or int(genai.get("context_length", 2048))
            if max_seq_len is not None and not 0 < max_seq_len <= exported:
                raise UserError(f"max_seq_len={max_seq_len} is outside the model's RoPE table (1..{exported}); "
                                "re-export with a larger max_seq_len")
            slots = self.max_seq_len = max_seq_len or exported

        # One [1, Hkv, slots, D] buffer per layer and side, bound as both past and present; ORT
        # writes into these numpy arrays' memory (kept here: the OrtValues only borrow it).
        shape = (1, int(n_kv), slots, int(head_dim))
        self.kv_buffers = [np.zeros(shape, self.kv_dtype) for _ in range(2 * self.n_layers)]
        self._kv = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.kv_buffers]
        self.windowed = WindowedKV(self.kv_buffers, slots, self.window) if self.max_seq_len == UNBOUNDED else None
        if self.windowed is not None:  # a verify step must not evict its own tokens (see WindowedKV)
            self.max_draft_tokens = self.window - 1
        # Decode-step tensors live in numpy arrays that the bound OrtValues share (no copies per token).
        self._ones = np.ones((1, slots), np.int64) if self.windowed is None else None
        self._pos = np.zeros((1, 1), np.int64)
        self._pos_value = ort.OrtValue.ortvalue_from_numpy(self._pos)
        self._ids = np.zeros((1, 1), np.int64)
        self._logits = np.zeros((1, 1, self.vocab_size), np.float32)
        self._ids_value = ort.OrtValue.ortvalue_from_numpy(self._ids)
        self._logits_value = ort.OrtValue.ortvalue_from_numpy(self._logits)
        self._decode_bound = False
        self._binding = self.session.io_binding()
        # Bound first so that it stays output 0 (re-binding a name keeps its place).
        self._binding.bind_ortvalue_output("logits", self._logits_value)
        for i in range(self.n_layers):
            for j, kv in enumerate(("key", "value")):
                buf = self._kv[2 * i + j]
                self._binding.bind_ortvalue_input(f"past_key_values.{i}.{kv}", buf)
                self._binding.bind_ortvalue_output(f"present.{i}.{kv}", buf)

    def forward(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        n = len(tokens)
        if n == 0:
            return np.zeros((0, self.vocab_size), np.float32)
        if start_pos < 0 or start_pos + n > self.max_seq_len:
            raise UserError(f"the sequence would reach {start_pos + n} tokens but the ONNX model's KV buffer holds "
                            f"{self.max_seq_len}; re-export with a larger max_seq_len or use a shorter prompt")
        b = self._binding
        decode = n == 1
        if decode:  # the bound ids/logits tensors share self._ids / self._logits: nothing is allocated
            self._ids[0, 0] = tokens[0]
            self._pos[0, 0] = start_pos
            if not self._decode_bound:
                b.bind_ortvalue_input("input_ids", self._ids_value)
                b.bind_ortvalue_output("logits", self._logits_value)
                if self.windowed is not None:
                    b.bind_ortvalue_input("position_ids", self._pos_value)
        else:
            b.bind_cpu_input("input_ids", np.asarray(tokens, np.int64)[None])
            b.bind_output("logits")
            if self.windowed is not None:
                b.bind_cpu_input("position_ids", np.arange(start_pos, start_pos + n, dtype=np.int64)[None])
        self._decode_bound = decode
        if self.windowed is None:
            # The mask is a prefix of a ones row: bind it by pointer rather than copying it.
            b.bind_input("attention_mask", "cpu", 0, np.int64, [1, start_pos + n], self._ones.ctypes.data)
        else:
            self.windowed.before_step(start_pos, n)
        self.session.run_with_iobinding(b)
        if self.windowed is not None:
            self.windowed.after_step(start_pos + n)
        if decode:
            return self._logits[0].copy()
        return b.get_outputs()[0].numpy()[0].astype(np.float32, copy=False)

    def rollback(self, length: int) -> None:
        """Positional: the next forward's length decides what is visible and stale slots are
        overwritten (a window graph re-lays its buffers then, see `WindowedKV`)."""

    def reset(self) -> None:
        # Likewise: a sequence restarting at position 0 overwrites from slot 0.
        if self.windowed is not None:
            self.windowed.reset()

    def export_cache(self, length: int) -> dict[str, np.ndarray] | None:
        """The buffers' contents that hold positions < `length` (a saved session): a full buffer's first
        `length` slots; a window buffer whole, and only when it describes exactly `length` tokens (after
        rejected speculative tokens it holds more, and their evicted rows are not restorable from a
        file: None, the session then saves its token ids only)."""
        if self.windowed is None:
            return {f"kv{i}": b[:, :, :length] for i, b in enumerate(self.kv_buffers)}
        if self.windowed.length != length:
            return None
        return {f"kv{i}": b for i, b in enumerate(self.kv_buffers)}

    def cache_shapes(self, length: int) -> dict[str, tuple[int, ...]]:
        return {f"kv{i}": b.shape[:2] + ((length,) if self.windowed is None else b.shape[2:3]) + b.shape[3:]
                for i, b in enumerate(self.kv_buffers)}

    def import_cache(self, arrays: dict[str, np.ndarray], length: int) -> None:
        """Put back what `export_cache(length)` returned, in place: the bound OrtValues share these buffers."""
        for i, b in enumerate(self.kv_buffers):
            b[:, :, :arrays[f"kv{i}"].shape[2]] = arrays[f"kv{i}"]
        if self.windowed is not None:
            self.windowed.reset()
            self.windowed.after_step(length)


class _StaticGraph:
    """One fixed-shape graph of a static model: its session and the shapes the host must feed."""

    def __init__(self, path: Path, session: Any):
        self.path, self.session = path, session
        inputs = {i.name: i for i in session.get_inputs()}
        past = [n for n in inputs if n.startswith("past_key_values.")]
        if "attention_bias" not in inputs or not past:
            raise UserError(f"{path} is not a static decode graph (no attention_bias / past_key_values inputs)")
        self.n_layers = len(past) // 2
        _, self.n_kv, self.slots, self.head_dim = (int(d) for d in inputs["past_key_values.0.key"].shape)
        self.chunk = int(inputs["input_ids"].shape[1])
        self.kv_dtype = _ORT_TYPES[inputs["past_key_values.0.key"].type]
        self.ids_dtype = _ORT_TYPES[inputs["input_ids"].type]
        self.pos_dtype = _ORT_TYPES[inputs["position_ids"].type]
        self.outputs = [o.name for o in session.get_outputs()]
        self.vocab_size = int(next(o for o in session.get_outputs() if o.name == "logits").shape[-1])
        self.artefact = read_spec("onnx", session.get_modelmeta().custom_metadata_map)


class OrtStaticBackend:
    """Fixed-shape graphs (batch 1, S tokens per call, W cache slots), e.g. the QNN context models.

    `onnx_dir_or_path` is the token generator (S = 1, or any S); `prefill` optionally adds a prompt
    processor (S > 1) over the same cache layout, as Qualcomm's Genie pairs them: prompts go through
    it in chunks of S (the last one padded), and single tokens through the generator.

    `session` / `prefill_session` let the caller pass sessions built with special options (an EP
    plugin); otherwise CPU sessions are created. `observer`, if given, sees every feed before it runs
    (quantization calibration records them; the cache arrays in a feed are views: copy to keep them).

    `sink` ([n_layers, 2 (key, value), n_kv, head_dim], from `attention_sink`): the keys and values of
    one token at position 0, computed once in float, held in slot 0 for every sequence. The stream
    then sits at graph positions 1.. over the other slots, and the quantized graphs never see the
    first position's massive activations (PrefixQuant, Chen et al. 2024): on SmolLM2 the residual
    stream reaches |x| ~ 2e4 there and ~1e3 elsewhere, so the calibrated ranges shrink ~20x.
    """

    name = "onnxruntime"

    def __init__(self, onnx_dir_or_path: str | Path, providers: Sequence[Any] | None = None,
                 threads: int | None = None, session: Any | None = None, prefill: str | Path | None = None,
                 prefill_session: Any | None = None, observer: Callable[[dict[str, np.ndarray]], None] | None = None,
                 sink: np.ndarray | None = None):
        ort = _import_ort()

        def open_graph(path: Path, given: Any | None) -> _StaticGraph:
            return _StaticGraph(path, given or ort.InferenceSession(
                str(path), session_options(threads), providers=list(providers or ["CPUExecutionProvider"])))

        self.path = resolve_model_path(onnx_dir_or_path)
        self.graphs = [open_graph(self.path, session)]
        if prefill is not None:
            self.graphs.append(open_graph(resolve_model_path(prefill), prefill_session))
        self.graphs.sort(key=lambda g: g.chunk)
        first = self.graphs[0]
        layouts = {(g.n_layers, g.n_kv, g.slots, g.head_dim, g.vocab_size) for g in self.graphs}
        if len(layouts) > 1:
            raise UserError(f"{self.path} and {prefill} do not share one cache layout: build them from one model "
                            "with the same cache slots")
        self.n_layers, self.slots, self.vocab_size, self.kv_dtype = first.n_layers, first.slots, first.vocab_size, \
            first.kv_dtype
        self.window = first.artefact.kv.window or self.slots
        self.observer = observer
        self.k = np.zeros((self.n_layers, 1, first.n_kv, self.slots, first.head_dim), self.kv_dtype)
        self.v = np.zeros_like(self.k)
        self.slot_pos = np.full(self.slots, -1, np.int64)  # graph position held by each slot
        self.sink = None if sink is None else _checked_sink(sink, self.k.shape, self.path)
        self.offset = int(self.sink is not None)  # graph position of the stream's first token
        # The cache is a ring, so the stream is unbounded; RoPE tables bound the positions.
        rope = first.artefact.kv.max_seq_len
        self.max_seq_len = rope - self.offset if rope else UNBOUNDED
        self.reset()

    @property
    def session(self) -> Any:
        """The token generator's session (the graph with the fewest tokens per call)."""
        return self.graphs[0].session

    def _graph_for(self, remaining: int) -> _StaticGraph:
        """One token: the token generator. More: the largest prompt processor they fill, or, for a
        shorter tail, one padded call of the prompt processor rather than a call per token."""
        if remaining == 1:
            return self.graphs[0]
        full = [g for g in self.graphs if 1 < g.chunk <= remaining]
        return full[-1] if full else self.graphs[-1]

    def _call(self, graph: _StaticGraph, tokens: Sequence[int], start: int) -> np.ndarray:
        """Run `tokens` (at most graph.chunk) at positions start..; cache them; return their logits."""
        n, S = len(tokens), graph.chunk
        start += self.offset  # graph positions
        qpos = start + np.arange(S)  # padding continues the positions; nothing real ever sees it
        visible = ((self.slot_pos[None] >= 0) & (self.slot_pos[None] < start)
                   & (qpos[:, None] - self.slot_pos[None] < self.window))
        visible[:, :self.offset] = True  # the sink: always seen
        ids = np.zeros((1, S), graph.ids_dtype)
        ids[0, :n] = tokens
        feed = {"input_ids": ids, "position_ids": np.minimum(qpos, self.max_seq_len - 1)[None].astype(graph.pos_dtype),
                "attention_bias": np.where(visible, 0.0, MASK_OFF).astype(np.float32)[None, None]}  # [1, 1, S, W]
        for i in range(self.n_layers):
            feed[f"past_key_values.{i}.key"] = self.k[i]
            feed[f"past_key_values.{i}.value"] = self.v[i]
        if self.observer is not None:
            self.observer(feed)
        out = dict(zip(graph.outputs, graph.session.run(None, feed)))
        ring = self.slots - self.offset  # the sink keeps slot 0
        slots = self.offset + (start - self.offset + np.arange(n)) % ring
        for i in range(self.n_layers):
            self.k[i][:, :, slots] = out[f"present.{i}.key"][:, :, :n]
            self.v[i][:, :, slots] = out[f"present.{i}.value"][:, :, :n]
        self.slot_pos[slots] = start + np.arange(n)
        return out["logits"].reshape(S, -1)[:n].astype(np.float32)

    def forward(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        if start_pos + len(tokens) > self.max_seq_len:
            raise UserError(f"position {start_pos + len(tokens)} is beyond the model's RoPE table "
                            f"({self.max_seq_len} positions); re-export with a larger max_seq_len")
        self.rollback(start_pos)
        out, i = [], 0
        while i < len(tokens):
            graph = self._graph_for(len(tokens) - i)
            n = min(graph.chunk, len(tokens) - i)
            out.append(self._call(graph, tokens[i:i + n], start_pos + i))
            i += n
        return np.concatenate(out) if out else np.zeros((0, self.vocab_size), np.float32)

    def rollback(self, length: int) -> None:
        """Hide positions >= length. Exact for k rolled-back tokens when slots >= window - 1 + k (the
        rejected tokens must not have overwritten history still inside the window)."""
        self.slot_pos[self.slot_pos >= length + self.offset] = -1

    def reset(self) -> None:
        self.slot_pos[:] = -1
        if self.sink is not None:
            self.k[:, 0, :, 0], self.v[:, 0, :, 0] = self.sink[:, 0], self.sink[:, 1]
            self.slot_pos[0] = 0


def _checked_sink(sink: np.ndarray, cache_shape: tuple[int, ...], graph: Path) -> np.ndarray:
    """The sink's keys and values, checked against the graph's cache [n_layers, 1, n_kv, slots, head_dim]."""
    n_layers, _, n_kv, slots, head_dim = cache_shape
    sink = np.asarray(sink)
    if sink.shape != (n_layers, 2, n_kv, head_dim) or not np.issubdtype(sink.dtype, np.floating) \
            or not np.isfinite(sink).all():
        raise UserError(f"the attention sink does not fit {graph.name}: expected finite floats of shape "
                        f"{(n_layers, 2, n_kv, head_dim)}, got {sink.dtype} {sink.shape}; rebuild the bundle")
    if slots < 2:
        raise UserError(f"{graph.name} has {slots} cache slot(s): an attention sink needs at least 2")
    return sink


def attention_sink(static_graph: Path, token: int) -> np.ndarray:
    """The float keys and values of `token` at position 0 ([n_layers, 2, n_kv, head_dim]), computed by
    the (float) static graph itself, for `OrtStaticBackend(sink=...)`."""
    backend = OrtStaticBackend(static_graph, threads=1)
    backend.forward([token], 0)
    return np.stack([backend.k[:, 0, :, 0], backend.v[:, 0, :, 0]], 1).astype(np.float32)


def recorded_feeds(static_graph: Path, token_streams: Sequence[Sequence[int]], max_calls: int = 16,
                   sink: np.ndarray | None = None) -> list[dict[str, np.ndarray]]:
    """The inputs of every call the static graph runs while reading `token_streams` (teacher forced),
    at most `max_calls`, behind `sink` if given: what QDQ calibration observes
    (`edgefinfer.compile.qnn.build_qnn`)."""
    feeds: list[dict[str, np.ndarray]] = []
    # The cache arrays in a feed are the backend's own (updated in place): keep copies.
    backend = OrtStaticBackend(static_graph, threads=1, sink=sink,
                               observer=lambda feed: feeds.append({k: v.copy() for k, v in feed.items()}))
    chunk = backend.graphs[0].chunk
    for stream in token_streams:
        backend.reset()
        backend.forward(list(stream)[: min((max_calls - len(feeds)) * chunk, backend.max_seq_len)], 0)
        if len(feeds) >= max_calls:
            break
    return feeds
