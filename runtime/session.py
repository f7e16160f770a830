"""Conversations that keep their KV cache between turns, and their file on disk.

    session = engine.session()
    for delta in session.chat("Hi!"): ...           # the model's chat template over the whole history
    for delta in session.chat("And then?"): ...     # prefills only the new turn
    session.save("chat.efs"); session = engine.load_session("chat.efs")

A turn renders the *whole* conversation to token ids, exactly as a stateless run of that history
would, and keeps the longest common prefix of those ids with the ids the cache holds (`keep_length`):
the cache is rolled back to it and only the rest is prefilled, so editing or regenerating the last
turn re-prefills only from the first token that changed. `Session.stream(text)` does the same over
plain text (the transcript so far + `text`).

Only what a prefill computed is kept. llama.cpp and ONNX Runtime compute a prompt's rows the same
however it is cut into chunks, but a one-token decode step rounds differently (its kernels take
another path for one row: logits off by up to ~1 on SmolLM2's Q4_1 GGUF and int4 ONNX, enough to flip
a greedy choice within a few tokens). On such a backend (`prefill_grid`, see `backends.base`) the last
reply, computed step by step, is prefilled again as soon as it ends (before the user's next message,
so the next turn's first token does not wait for it: `TurnStats.settle_s`), and every kept position
holds what a stateless prefill of the history holds, bit for bit: greedy replies are a stateless
run's. An ExecuTorch program's rows also change with where a call starts and how long it is (up to
~1 logit on the android default; `rows_depend_on_calls`), so a chat session there feeds the
conversation in turn-aligned calls (`reply_spans`): each turn's new prompt in one call, from the end
of the previous assistant turn, and once a reply is written the assistant turn itself in one call (its
ids as the template renders them, off the next turn's clock), and it keeps rows only up to such a call
boundary (an edit re-prefills the edited turn from its start). A stateless run of the history fed in
the same calls (`conversation_cuts`, `Engine.stream_ids(cuts=...)`) computes every row bit for bit as
the session did, so the replies are the same; one call over the whole history computes other rows
and may part from them. Loaded with a grid G (`--prefill-grid`) a program instead feeds every prompt
in calls aligned to G, and a session keeps rows up to the last whole chunk of the grid only (the
partial one is fed again with the next turn): any cut of a prompt then gives the same rows, at the
cost of slower prefills. Plain-text sessions (`stream`) on ExecuTorch without a grid, and eager torch
(whose rows differ by float noise, ~4e-5 on SmolLM2), keep the decoded reply as it is, as
`Engine.session(exact=False)` does. A reply whose stream the caller closed (Ctrl-C in
`edgefinfer chat`) is not settled; the next turn prefills it instead.

What each cache layout allows (the backends' own rollbacks are reused, see `backends.base`):
- static caches (torch, ExecuTorch, ONNX Runtime, llama.cpp, the paged torch cache): any rollback is
  exact (positional, or llama.cpp's `llama_memory_seq_rm`); a conversation that outgrows the context
  is refused before the cache is touched (`decode.check_fits`), one line, the session as it was.
- window (ring) caches (torch, ExecuTorch, ONNX Runtime `--kv window`): a turn that extends the cached
  ids prefills only the new ones and the conversation streams past the context; a turn that would roll
  back (an edit, a retokenized reply) re-prefills the whole history from position 0, because the ring
  no longer holds what a rollback would uncover. Exact either way, only slower.

The session file (`save` / `load_session`), version `FORMAT_VERSION`:

    MAGIC, u64 little-endian header length, header (JSON), payload (the arrays, back to back)

The header names the artefact's sha256, the backend, the cache layout and the cached token ids, so a
file is refused (one UserError line, nothing touched) on another model, backend, layout or version,
and when truncated or damaged (payload sha256). `state` says what the payload holds: "kv" (the cache
contents: torch and ONNX Runtime tensors, llama.cpp's `llama_state_seq_get_data` blob, an ExecuTorch
program's own K/V buffers through `Method.get_attribute`) or "tokens" (none: a .pte exported before
edgefinfer named its buffers, the paged cache and the QNN graphs; the next turn then prefills the
history).
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from edgefinfer.files.atomic import atomic_file
from edgefinfer.errors import UserError
from edgefinfer.decoding.generation import Generation, encode_prompt
from edgefinfer.runtime.backends.base import last_logits
from edgefinfer.runtime.decode import check_fits
from edgefinfer.decoding.sampling import SamplingParams
from edgefinfer.tokenization.tokenizer import Tokenizer

if TYPE_CHECKING:
    import threading

    from edgefinfer.runtime.backends.base import Backend
    from edgefinfer.runtime.engine import Engine, ResponseFormat

FORMAT_VERSION = 1
MAGIC = b"EDGEFINFER-SESSION\n"
_LEN = struct.Struct("<Q")


@dataclass
class TurnStats:
    """What the last turn cost: how much of the prompt came from the cache."""

    prompt_tokens: int = 0
    reused_tokens: int = 0  # kept in the cache from earlier turns
    prefilled_tokens: int = 0  # fed in this turn's prefill
    generated_tokens: int = 0
    ttft_s: float = 0.0
    decode_tok_s: float = 0.0
    settle_s: float = 0.0  # after the reply: prefilling its decoded tokens again (module docstring)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def keep_length(backend: Backend, cached: Sequence[int], ids: Sequence[int], prefilled: int | None = None) -> int:
    """How many leading `ids` may stay in a cache that holds `cached`, of which the first `prefilled`
    were computed by prefills (None: all of them; see the module docstring)."""
    keep = min(common_prefix(cached, ids), len(ids) - 1)  # the last id is always fed: its logits start the reply
    if backend.window is not None:
        return 0 if keep < len(cached) else keep  # a ring cannot roll back in general: re-prefill from 0
    grid = getattr(backend, "prefill_grid", None)
    if prefilled is not None and grid:
        keep = min(keep, prefilled) // grid * grid  # decoded rows and partial chunks: compute them again
    return keep


def encode_messages(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """A conversation's ids through the chat template, as `encode_prompt(chat=True)` encodes one turn."""
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def turn_aligned(backend: Backend) -> bool:
    """Whether a conversation on `backend` is fed in turn-aligned calls (`reply_spans`): its rows change with
    where a call starts and ends (`rows_depend_on_calls`) and no grid (`prefill_grid`) makes them a
    function of the ids alone, nor does a ring (which re-prefills from 0 instead)."""
    return (getattr(backend, "rows_depend_on_calls", False) and getattr(backend, "prefill_grid", None) is None
            and backend.window is None)


def reply_spans(tokenizer: Tokenizer, messages: list[dict[str, str]], ids: Sequence[int] | None = None,
                memo: dict | None = None) -> list[tuple[int, int]]:
    """[start, end) of each assistant turn in `ids` (default: the conversation's own, `encode_messages`):
    start is the length of the prompt that asked for the reply, end the length of the history rendered
    up to and including the turn (the reply and the template's end-of-turn marks). A turn whose
    renderings are not prefixes of `ids` (a template that renders earlier turns differently) has none.

    These are where a session's calls start and end on a turn-aligned backend (`turn_aligned`): a turn
    feeds [previous turn's end, its prompt's end) in one call, and once the reply is written the
    assistant turn itself in one call (`Session._settle`); a stateless run of the same history fed
    in the same calls (`conversation_cuts`) computes every row bit for bit as the session did.

    `memo`: renderings of earlier turns kept between calls (a session's: each turn then renders only
    its own, not the whole history again)."""
    ids = list(ids) if ids is not None else encode_messages(tokenizer, messages)
    memo = memo if memo is not None else {}
    spans, key = [], ()
    for i, m in enumerate(messages):
        key = (*key, (m["role"], m["content"]))
        if m["role"] != "assistant" or i == 0:
            continue
        if key not in memo:
            prompt = encode_messages(tokenizer, messages[:i])
            turn = tokenizer.encode(tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False),
                                    add_special_tokens=False)
            memo[key] = (len(prompt), turn if turn[:len(prompt)] == prompt else None)
        start, turn = memo[key]
        if turn is not None and start < len(turn) <= len(ids) and ids[:len(turn)] == turn:
            spans.append((start, len(turn)))
    return spans


def conversation_cuts(engine: Engine, messages: list[dict[str, str]], memo: dict | None = None,
                      ids: Sequence[int] | None = None) -> tuple[int, ...]:
    """Where a stateless run of `messages` (rendered as `ids`, if already at hand) cuts its prefill to
    make a session's calls on `engine`'s backend (`Engine.stream_ids(cuts=...)`); none where the
    backend's rows do not depend on them."""
    if not turn_aligned(engine.backend):
        return ()
    return tuple(sorted({x for span in reply_spans(engine.tokenizer, messages, ids, memo) for x in span}))


class Session:
    """One conversation over an Engine's backend. Not thread-safe (nor is the Engine's cache)."""

    def __init__(self, engine: Engine, exact: bool = True):
        """exact: keep only prefilled positions where decode steps round differently (module docstring)."""
        self.engine = engine
        self.exact = exact
        self.messages: list[dict[str, str]] = []  # chat(): the history, editable between turns
        self.transcript = ""  # stream(): the text so far
        self.cached: list[int] = []  # ids the backend holds at positions 0.. (while this session owns it)
        self.prefilled = 0  # cached[:prefilled] were computed by prefills, the rest by decode steps
        self._aligned = False  # the last turn was fed in turn-aligned calls (`turn_aligned`)
        self._memo: dict = {}  # `reply_spans`' renderings of this conversation's turns
        self.last = TurnStats()

    @property
    def cached_tokens(self) -> int:
        return len(self._valid_cache())

    def _valid_cache(self) -> list[int]:
        return self.cached if self.engine.cache_owner is self else []

    def reset(self) -> None:
        """Forget the conversation (the cache is overwritten by the next turn)."""
        self.messages, self.transcript, self.cached, self.prefilled, self.last = [], "", [], 0, TurnStats()
        self._memo.clear()

    # ---- turns ----
    def chat(self, message: str, max_tokens: int = 128, **kw: Any) -> Iterator[str]:
        """Stream the reply to a user message; it joins the history (a partial one too, when stopped)."""
        history = [*self.messages, {"role": "user", "content": message}]

        def commit(reply: str) -> None:
            self.messages = [*history, {"role": "assistant", "content": reply}]

        return self._turn(encode_messages(self.engine.tokenizer, history), commit, max_tokens, history=history, **kw)

    def edit(self, message: str, max_tokens: int = 128, **kw: Any) -> Iterator[str]:
        """Replace the last user message (and drop its reply): only the tokens from the edit on are prefilled."""
        last = max((i for i, m in enumerate(self.messages) if m["role"] == "user"), default=None)
        if last is None:
            raise UserError("there is no user message to edit yet; send one with chat()")
        kept = self.messages[:last]
        history = [*kept, {"role": "user", "content": message}]

        def commit(reply: str) -> None:
            self.messages = [*history, {"role": "assistant", "content": reply}]

        return self._turn(encode_messages(self.engine.tokenizer, history), commit, max_tokens, history=history, **kw)

    def stream(self, text: str, max_tokens: int = 128, **kw: Any) -> Iterator[str]:
        """Continue the plain-text transcript with `text` and stream the continuation (which joins it)."""
        full = self.transcript + text

        def commit(reply: str) -> None:
            self.transcript = full + reply

        return self._turn(encode_prompt(self.engine.tokenizer, full, False), commit, max_tokens, **kw)

    def _turn(self, ids: list[int], commit: Callable[[str], None], max_tokens: int = 128,
              params: SamplingParams = SamplingParams(), stop: list[str] | None = None,
              on_token: Callable[[int], None] | None = None, cancel: threading.Event | None = None,
              result: Generation | None = None, response_format: ResponseFormat = None,
              history: list[dict[str, str]] | None = None) -> Iterator[str]:
        """history: the messages `ids` render (chat turns), for a turn-aligned backend's cuts."""
        backend = self.engine.backend
        check_fits(backend, len(ids), max_tokens)  # before anything changes: a refused turn loses nothing
        keep = keep_length(backend, self._valid_cache(), ids, self.prefilled if self.exact else None)
        cuts: tuple[int, ...] = ()
        self._aligned = self.exact and history is not None and turn_aligned(backend)
        if self._aligned:
            # Rows are kept only up to a call boundary of a stateless run of this history, and only as a
            # prefill computed them (`prefilled`: the settled reply, or the prompt of an unsettled one).
            cuts = conversation_cuts(self.engine, history, self._memo, ids)
            keep = max((c for c in (0, *cuts) if c <= min(keep, self.prefilled)), default=0)
        result = result if result is not None else Generation("", [], "length")
        produced: list[int] = []

        def seen(tok: int) -> None:
            produced.append(tok)
            if on_token is not None:
                on_token(tok)

        self.cached = ids[:keep]  # what survives the rollback, whatever happens next
        self.prefilled = min(self.prefilled, keep)
        clean = False
        try:
            yield from self.engine.stream_ids(ids, max_tokens, params, stop, seen, cancel, result, response_format,
                                              cached=keep, owner=self, cuts=cuts)
            clean = True
        except GeneratorExit:  # the caller stopped the reply (Ctrl-C in `edgefinfer chat`): a clean stop
            clean = True
            raise
        finally:
            if produced:  # the cache holds the prompt and every produced token but the last (decode.py)
                commit(result.text)
                interrupted_ring = not clean and backend.window is not None
                self.cached = [] if interrupted_ring else ids + produced[:-1]
                self.prefilled = 0 if interrupted_ring else len(ids)
            elif backend.window is not None:
                self.cached = []  # a failed prefill may have moved the ring
            s = result.stats
            self.last = TurnStats(len(ids), keep, len(ids) - keep, s.generated_tokens, s.prefill_s, s.decode_tok_s)
        self.last.settle_s = self._settle()  # only after a reply that ran to its end

    def _settle(self) -> float:
        """Prefill again what decode steps computed, where they round differently from a prefill (module
        docstring): on a turn-aligned backend the assistant turn just written, as the next turn renders
        it; on a grid, the decoded tail from the last whole chunk of the grid. The seconds it took, 0.0
        when there was nothing to do."""
        backend = self.engine.backend
        grid = getattr(backend, "prefill_grid", None)
        if self._aligned:
            target = self._written_turn()
        elif self.exact and grid and backend.window is None and self.prefilled < len(self.cached):
            target = self.prefilled // grid * grid, self.cached  # a partial chunk of the grid is fed again
        else:
            target = None
        return self._refeed(*target) if target is not None else 0.0

    def _written_turn(self) -> tuple[int, list[int]] | None:
        """(start, ids) of the assistant turn just written, as the next turn renders it (`reply_spans`:
        the reply's ids as the template writes them, and its end-of-turn marks); None where the cache
        does not hold its prompt as rendered (a retokenized turn)."""
        tokenizer = self.engine.tokenizer
        ids = encode_messages(tokenizer, self.messages)
        spans = reply_spans(tokenizer, self.messages, ids, self._memo)
        if not spans:
            return None
        start, end = spans[-1]
        if start != self.prefilled or ids[:start] != self.cached[:start]:
            return None  # not this reply's span (its turn renders otherwise), or not the prompt the cache holds
        return start, ids[:end]

    def _refeed(self, start: int, ids: list[int]) -> float:
        """Feed ids[start:] again at `start` as one prefill; the cache then holds `ids`, all prefilled.
        Not if another stream holds the engine or its cache (the next turn prefills what is left)."""
        engine, backend = self.engine, self.engine.backend
        if not engine._lock.acquire(blocking=False):
            return 0.0
        try:
            if engine.cache_owner is not self:
                return 0.0
            t0 = time.perf_counter()
            backend.rollback(start)
            last_logits(backend, ids[start:], start)
            self.cached, self.prefilled = list(ids), len(ids)
            return time.perf_counter() - t0
        finally:
            engine._lock.release()

    # ---- disk ----
    def save(self, path: str | Path) -> Path:
        """Write the session (history, cached ids, cache contents where the backend can export them)
        atomically: a temporary file beside `path`, then a rename."""
        backend = self.engine.backend
        cached = self._valid_cache()
        export = getattr(backend, "export_cache", None)
        arrays = export(len(cached)) if cached and export is not None else None
        header: dict[str, Any] = {
            "format": "edgefinfer-session", "version": FORMAT_VERSION, **identity(self.engine),
            "state": "kv" if arrays is not None else "tokens", "tokens": list(cached),
            "prefilled_tokens": min(self.prefilled, len(cached)),
            "messages": self.messages, "transcript": self.transcript, "arrays": [],
        }
        payload = bytearray()
        for name, array in (arrays or {}).items():
            data = np.ascontiguousarray(array)
            header["arrays"].append({"name": name, "dtype": data.dtype.str, "shape": list(data.shape),
                                     "nbytes": data.nbytes})
            payload += data.tobytes()
        header["payload_sha256"] = hashlib.sha256(payload).hexdigest()
        head = json.dumps(header).encode()
        path = Path(path)
        try:
            with atomic_file(path) as tmp, open(tmp, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(head)) + head)
                f.write(payload)
        except (IsADirectoryError, NotADirectoryError, PermissionError, FileNotFoundError) as e:
            raise UserError(f"cannot write the session to {path}: {e.strerror}") from None
        return path


def identity(engine: Engine) -> dict[str, str]:
    """What a session file must match to be loaded here: the artefact, the backend, the cache layout."""
    if "sha256" not in engine.info:  # a bundle's manifest names it; a bare artefact is hashed once
        engine.info["sha256"] = artefact_sha256(Path(engine.info["path"]))
    return {"artefact_sha256": engine.info["sha256"], "backend": engine.backend.name,
            "cache": cache_layout(engine.backend)}


def artefact_sha256(path: Path) -> str:
    """A file's sha256; a folder's: the sha256 of its files' names and sha256s (sorted)."""
    from edgefinfer.files.hashes import known_sha256

    if path.is_file():
        return known_sha256(path)
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{file.relative_to(path)}\0{known_sha256(file)}\n".encode())
    return h.hexdigest()


def cache_layout(backend: Backend) -> str:
    """A one-line name of a backend's cache layout, equal for two backends whose caches can swap contents."""
    parts = [type(backend).__name__, f"max_seq_len={backend.max_seq_len}", f"window={backend.window}"]
    for name in ("num_sinks", "lookahead", "max_draft_tokens"):
        if getattr(backend, name, None) is not None:
            parts.append(f"{name}={getattr(backend, name)}")
    cells = getattr(backend, "cells", None)
    if cells is not None:  # llama.cpp's cell format: its saved cells restore into the same format only
        parts.append(cells.describe().replace(" ", "-"))
    cache = getattr(backend, "cache", None)
    if cache is not None:  # the torch caches: their buffers' shape is the layout
        parts.append(f"{type(cache).__name__}{tuple(cache.k.shape)}")
    if getattr(backend, "kv_buffers", None):
        parts.append(f"kv{tuple(backend.kv_buffers[0].shape)}x{len(backend.kv_buffers)}")
    return " ".join(parts)


def read_session_file(path: str | Path) -> tuple[dict[str, Any], bytes]:
    """(header, payload) of a session file; a UserError naming what is wrong otherwise."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"no session file at {path}; save one with /save FILE (or Session.save)") from None
    except OSError as e:
        raise UserError(f"cannot read the session file {path}: {e.strerror}") from None
    if not data.startswith(MAGIC):
        raise UserError(f"{path} is not an edgefinfer session file (it does not start with {MAGIC[:-1].decode()})")
    at = len(MAGIC) + _LEN.size
    if len(data) < at:
        raise UserError(f"the session file {path} is truncated ({len(data)} bytes); save the session again")
    (head_len,) = _LEN.unpack_from(data, len(MAGIC))
    if len(data) < at + head_len:
        raise UserError(f"the session file {path} is truncated (its header is cut); save the session again")
    try:
        header = json.loads(data[at:at + head_len])
        version = header["version"]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"the session file {path} has a damaged header; save the session again") from None
    if version != FORMAT_VERSION:
        raise UserError(f"{path} is a version {version} session file; this edgefinfer reads version "
                        f"{FORMAT_VERSION}: save the session again with this version")
    payload = data[at + head_len:]
    try:
        expected = sum(int(a["nbytes"]) for a in header["arrays"])
        digest = header["payload_sha256"]
    except (KeyError, TypeError, ValueError):
        raise UserError(f"the session file {path} has a damaged header; save the session again") from None
    if len(payload) < expected:
        raise UserError(f"the session file {path} is truncated ({len(payload)} of {expected} cache bytes); "
                        "save the session again")
    if len(payload) != expected or hashlib.sha256(payload).hexdigest() != digest:
        raise UserError(f"the session file {path} is damaged (its cache does not match its checksum); "
                        "save the session again")
    return header, payload


@dataclass(frozen=True)
class SessionFile:
    """A session file's contents, parsed and checked once (`read_session`)."""

    path: Path
    artefact_sha256: str | None
    backend: str | None
    cache: str | None
    tokens: list[int]
    prefilled: int  # tokens[:prefilled] were computed by prefills (files before the field: all of them)
    messages: list[dict[str, str]]
    transcript: str
    arrays: dict[str, np.ndarray] | None  # None: state "tokens" (the cache itself was not saved)


def read_session(path: str | Path) -> SessionFile:
    """A session file parsed (`read_session_file`, then its fields typed); a UserError if damaged."""
    header, payload = read_session_file(path)
    try:
        return SessionFile(
            Path(path), header.get("artefact_sha256"), header.get("backend"), header.get("cache"),
            [int(t) for t in header["tokens"]], int(header.get("prefilled_tokens", len(header["tokens"]))),
            [{"role": str(m["role"]), "content": str(m["content"])} for m in header["messages"]],
            str(header["transcript"]), _arrays(header["arrays"], payload) if header["state"] == "kv" else None)
    except (KeyError, TypeError, ValueError):
        raise UserError(f"the session file {path} has a damaged header; save the session again") from None


def load_session(engine: Engine, path: str | Path) -> Session:
    """A Session from `Session.save`'s file, its cache restored into the engine's backend. Everything is
    checked before the backend is touched: on a refusal any other session keeps its cache."""
    saved = read_session(path)
    here = identity(engine)
    what = {"backend": "backend (", "artefact_sha256": "model (artefact sha256", "cache": "cache layout ("}
    for key, name in what.items():
        if getattr(saved, key) != here[key]:
            raise UserError(f"{path} was saved with another {name} {getattr(saved, key)!r}, here {here[key]!r}); "
                            "load it with the engine it was saved with")
    tokens, arrays = saved.tokens, saved.arrays
    backend = engine.backend
    if arrays is not None:
        shapes = backend.cache_shapes(len(tokens)) if hasattr(backend, "cache_shapes") else None
        if shapes is not None and {n: a.shape for n, a in arrays.items()} != shapes:
            raise UserError(f"{path} holds a cache of another shape than this backend's; load it with the "
                            "engine it was saved with")
    if tokens and (len(tokens) > backend.max_seq_len or max(tokens) >= backend.vocab_size or min(tokens) < 0):
        raise UserError(f"the session file {path} holds token ids this model cannot take; save the session again")
    session = Session(engine)
    session.messages, session.transcript = saved.messages, saved.transcript
    if arrays is not None and tokens:
        with engine._lock:
            engine.cache_owner = None  # if the import fails half-way, no session trusts the cache
            backend.import_cache(arrays, len(tokens))
            engine.cache_owner = session
        session.cached, session.prefilled = tokens, min(saved.prefilled, len(tokens))
    return session


def _arrays(specs: list[dict[str, Any]], payload: bytes) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for spec in specs:
        dtype, shape, nbytes = np.dtype(spec["dtype"]), tuple(int(d) for d in spec["shape"]), int(spec["nbytes"])
        if dtype.hasobject or int(np.prod(shape)) * dtype.itemsize != nbytes:
            raise ValueError(spec)
        out[str(spec["name"])] = np.frombuffer(payload, dtype, int(np.prod(shape)), at).reshape(shape)
        at += nbytes
    return out
