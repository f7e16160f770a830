"""What is computed from a file, remembered per version of the file instead of computed on every start.

    value = remembered(path, "sha256-stamps.json", sha256_file)      # a digest (edgefinfer.files.hashes)
    header = remembered(gguf, "gguf-headers.json", walk, tag=CHECKER) # a checked header (files.untrusted)

A value is kept under the file's resolved path with its identity and change stamps, (device, inode, size,
mtime, ctime), in `cache_dir() / store`; while they are unchanged the value is taken from there. Any
write to the file, or a rename over it, changes its ctime or inode, and ctime cannot be set back by a
user (only by changing the system clock), so a changed file is computed again. File timestamps are
coarse (a kernel tick): a write in the same tick as the computation could keep every stamp, so a value
is remembered only for a file whose last change is at least `SETTLED_S` old when it is computed (git's
index treats "racily clean" files the same way). `tag` names the code that computed the value (a
checker's version): an entry under another tag is computed again.

Values must survive JSON (lists come back for tuples: `decode` restores them). A `compute` that raises
remembers nothing. The store is best effort: unreadable, damaged or unwritable, it is ignored and the
value is computed as before.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from edgefinfer.files.user_cache import cache_dir

T = TypeVar("T")
SETTLED_S = 2.0
MAX_ENTRIES = 256  # each store stays small; the oldest entries go first


def stamp(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def remembered(path: str | Path, store: str, compute: Callable[[Path], T], *, tag: str = "",
               encode: Callable[[T], Any] = lambda v: v, decode: Callable[[Any], T] = lambda v: v) -> T:
    """`compute(path)`, or the value remembered in `store` while the file's stamps (and `tag`) are those
    it was computed under."""
    path = Path(path)
    st = os.stat(path)
    key = str(path.resolve())
    entries = _load(store)
    entry = entries.get(key)
    if isinstance(entry, list) and len(entry) == 7 and entry[:5] == stamp(st) and entry[5] == tag:
        try:
            return decode(entry[6])
        except (TypeError, ValueError, KeyError, IndexError):
            pass  # a damaged entry: computed again below
    value = compute(path)
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) >= SETTLED_S * 1e9:
        entries.pop(key, None)
        entries[key] = [*stamp(st), tag, encode(value)]
        _save(store, dict(list(entries.items())[-MAX_ENTRIES:]))
    return value


def _load(store: str) -> dict:
    try:
        data = json.loads((cache_dir() / store).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save(store: str, entries: dict) -> None:
    from edgefinfer.errors import UserError
    from edgefinfer.files.atomic import write_bytes

    try:
        (cache_dir() / store).parent.mkdir(parents=True, exist_ok=True)
        write_bytes(cache_dir() / store, json.dumps(entries).encode(), durable=False)
    except (OSError, UserError):  # a read-only or full cache: computed again next time
        pass
