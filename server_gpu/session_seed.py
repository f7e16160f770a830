"""`edgefinfer serve GGUF --session FILE`: a conversation saved on the device continues on the server.

A session file saved on the runtime's llama.cpp backend (`edgefinfer chat` /save, `Session.save`) holds
the token ids the device's cache held and llama.cpp's own serialisation of those cells
(`llama_state_seq_get_data`). `seed` restores that blob into one llama sequence of the server's pool
and hands the ids to the paged-KV manager as a retained prefix, exactly as if a request with that
prompt had just finished: a request whose prompt starts with the conversation (its messages and the
next one, or the transcript and the next text) copies those cells instead of computing them, to the
token (the retained prefix keeps its partial last block too), so only the new tokens are computed. The
prefix then lives as any retained prefix does: evicted when the pool needs its blocks.

What must match, checked before the model loads (`check`), else one line and exit code 2:
- the model: the file names the sha256 of the GGUF it ran on, which must be the served GGUF's (a
  bundle's manifest names it; a bare file is hashed once);
- the backend: llamacpp with its cache saved ("kv"). The other backends' files cannot seed a llama.cpp
  server: their caches are another runtime's tensors of another artefact (ONNX Runtime's int4 graph,
  torch's float weights, ExecuTorch's program buffers: other numbers for the same tokens);
- the cache layout: a static cache (a `--kv window` session has removed cells, so its positions no
  longer start at 0 contiguously) shorter than --max-model-len;
- the cells' format: llama.cpp restores cells only into a cache of the same K/V types and V layout, and
  the runtime keeps f32 K/V for float weights, f16 for quantized ones, both with plain attention
  (V transposed; `runtime_cells`). `kv_settings` makes those the
  defaults under --session, in the unified pool where retained prefixes live, and refuses flags that
  contradict them. llama.cpp checks the blob itself too (layers, sizes); its refusal is one line as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgefinfer.errors import UserError
from edgefinfer.runtime.kv.paged_manager import NoRoom, PagedKVManager
from edgefinfer.runtime.session import SessionFile, read_session


@dataclass(frozen=True)
class SeedId:
    """The manager's id of a seeded sequence while it is being registered (never a request's)."""

    number: int


def check(files: tuple[str, ...], gguf_sha256: str) -> list[SessionFile]:
    """Each session file parsed and checked against the served GGUF (see the module docstring)."""
    sessions = []
    for file in files:
        s = read_session(file)
        if s.backend != "llamacpp":
            raise UserError(f"{file} was saved on the {s.backend} backend; only a llama.cpp session (saved on a "
                            "GGUF) can seed `edgefinfer serve`, whose cache is llama.cpp's")
        if s.artefact_sha256 != gguf_sha256:
            raise UserError(f"{file} was saved with another model (artefact sha256 {s.artefact_sha256}, here "
                            f"{gguf_sha256}); serve the GGUF it was saved with")
        if s.cache is None or "window=None" not in s.cache.split():
            raise UserError(f"{file} was saved with a window cache ({s.cache}); only a static cache's cells can "
                            "seed the server (run without --kv window)")
        if s.arrays is None or "llama_state_seq" not in s.arrays:
            raise UserError(f"{file} holds no llama.cpp cache (state 'tokens'); save it again from a llama.cpp session")
        if not s.tokens:
            raise UserError(f"{file} holds an empty conversation; chat first, then save")
        sessions.append(s)
    return sessions


def seed(manager: PagedKVManager, storage, session: SessionFile, number: int, max_model_len: int) -> int:
    """Restore `session`'s cells into the pool as a retained prefix (before the engine starts); returns
    how many of its tokens the prefix cache keeps (all of them, within --retain-tokens)."""
    tokens, blob = session.tokens, session.arrays["llama_state_seq"]
    if len(tokens) >= max_model_len:
        raise UserError(f"{session.path} holds {len(tokens)} tokens; the server's --max-model-len is "
                        f"{max_model_len}: raise it above the conversation")
    seq_id = SeedId(number)
    plan = manager.allocate(seq_id, tokens)
    if isinstance(plan, NoRoom):
        raise UserError(f"{session.path} needs {plan.num_blocks_needed} KV blocks, the pool has {plan.num_free} "
                        "free; raise --kv-cells")
    plan.apply_to(storage)
    try:
        storage.ctx.restore(storage.slot(seq_id), blob.tobytes())
    except RuntimeError as e:
        raise UserError(f"llama.cpp refused the cache in {session.path} ({e}); it does not fit this server's "
                        "cache") from None
    manager.mark_computed(seq_id)
    event = manager.free(seq_id)
    event.apply_to(storage)
    if event.retained_as is None:
        raise UserError(f"{session.path}: the server keeps no retained prefixes (--retain-prefixes 0 or "
                        "--no-prefix-caching); drop those flags to seed it")
    return event.retained_tokens


def file_sha256(path: Path, known: str | None) -> str:
    """The served GGUF's sha256: a bundle's manifest names it (checked when it loaded), else hashed here."""
    if known:
        return known
    from edgefinfer.files.hashes import known_sha256

    return known_sha256(path)
