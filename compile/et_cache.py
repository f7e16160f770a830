"""The export cache: a finished .pte keyed by a content hash of everything that decides its bytes.

    key = export_key(model, opts)        # tensors, config, options, tool versions, exporter source
    hit = lookup(store, key)             # (path, metadata) or None
    store_program(store, key, pte, meta)

The store is `$EDGEFINFER_CACHE/executorch` by default: beside the build, not beside the output,
because the build pipeline writes every bundle into a fresh temporary folder. Files are written to
a temporary name and renamed, so an interrupted copy never looks like a hit (and a torn one, whose
size disagrees with its metadata, is ignored).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgefinfer import artefact
from edgefinfer.atomic import user_mode

# The exporter modules whose source is part of the key: editing them invalidates old programs.
SOURCES = ("executorch_export.py", "et_attention.py", "et_quant.py", "et_cache.py", "fusion.py")


def default_store() -> Path:
    from edgefinfer.data import cache_dir

    return cache_dir() / "executorch"


def export_key(model: nn.Module, opts: dict[str, Any]) -> str:
    """Content hash of the model's tensors and config, the export options, the torch / executorch /
    torchao versions and this exporter's source."""
    h = hashlib.blake2b(digest_size=20)
    h.update(json.dumps(opts, sort_keys=True, default=str).encode())
    h.update(json.dumps(model.config.to_hf(), sort_keys=True, default=str).encode())
    for name in ("torch", "executorch", "torchao"):
        h.update(f"{name}={_version(name)};".encode())
    here = Path(__file__).parent
    for src in SOURCES:
        h.update((here / src).read_bytes())
    h.update(Path(artefact.__file__).read_bytes())  # writes the program's constant methods
    seen: set[int] = set()
    for name, t in sorted(model.state_dict().items()):
        if t.data_ptr() in seen:  # tied weights are hashed once (their names still are)
            h.update(f"{name}=tied;".encode())
            continue
        seen.add(t.data_ptr())
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def lookup(store: Path, key: str) -> tuple[Path, dict[str, Any]] | None:
    pte, meta = store / f"{key}.pte", store / f"{key}.json"
    if not (pte.is_file() and meta.is_file()):
        return None
    try:
        info = json.loads(meta.read_text())
    except json.JSONDecodeError:
        return None
    if info.get("size_bytes") != pte.stat().st_size:
        return None
    return pte, info


def store_program(store: Path, key: str, pte: Path, meta: dict[str, Any]) -> None:
    try:
        copy_atomic(pte, store / f"{key}.pte")
        write_atomic(store / f"{key}.json", json.dumps(meta, indent=1).encode())
    except OSError:
        pass  # a read-only or full cache directory only costs the next build its shortcut


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, user_mode())  # mkstemp's 0600 would make model.pte unreadable to anyone else
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def copy_atomic(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    os.close(fd)
    try:
        os.chmod(tmp, user_mode())  # copyfile keeps the destination's mode: make it the user's, not 0600
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _version(name: str) -> str:
    try:
        return importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return "absent"
