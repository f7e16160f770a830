"""A file's sha256, computed once per version of the file rather than on every start.

A bundle's loader checks every artefact against the sha256 its manifest names (`bundle.verify_artefact`),
and a session file names its artefact's. Hashing reads the whole file, and the runtime then maps and reads
it again: every `edgefinfer run` read the weights twice (112 MB for the linux-x86_64 bundle). `known_sha256`
remembers a digest under the file's identity and change stamps, (device, inode, size, mtime, ctime), in
`cache_dir() / "sha256-stamps.json"`; while they are unchanged the digest is taken from there and the
weights are read once, by the runtime. Any write to the file, or a rename over it, changes its ctime or
inode, and ctime cannot be set back by a user (only by changing the system clock), so a changed file is
hashed again. File timestamps are coarse (a kernel tick): a write in the same tick as the hash could keep
every stamp, so a digest is remembered only for a file whose last change is at least `SETTLED_S` old
when it is hashed (git's index treats "racily clean" files the same way).

The store is best effort: unreadable, damaged or unwritable, it is ignored and files are hashed as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from edgefinfer.files.user_cache import cache_dir

STORE = "sha256-stamps.json"
SETTLED_S = 2.0
MAX_ENTRIES = 256  # the store stays a few KB; the oldest entries go first


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def stamp(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def known_sha256(path: str | Path) -> str:
    """`sha256_file(path)`, from the store while the file's stamps are those it was hashed under."""
    path = Path(path)
    st = os.stat(path)
    key = str(path.resolve())
    store = _load()
    entry = store.get(key)
    if isinstance(entry, list) and len(entry) == 6 and entry[:5] == stamp(st):
        return entry[5]
    digest = sha256_file(path)
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) >= SETTLED_S * 1e9:
        store.pop(key, None)
        store[key] = [*stamp(st), digest]
        _save(dict(list(store.items())[-MAX_ENTRIES:]))
    return digest


def _file() -> Path:
    return cache_dir() / STORE


def _load() -> dict:
    try:
        data = json.loads(_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save(store: dict) -> None:
    from edgefinfer.files.atomic import write_bytes
    from edgefinfer.errors import UserError

    try:
        _file().parent.mkdir(parents=True, exist_ok=True)
        write_bytes(_file(), json.dumps(store).encode(), durable=False)
    except (OSError, UserError):  # a read-only or full cache: hash again next time
        pass
