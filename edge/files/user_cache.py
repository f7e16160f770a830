"""Where edgefinfer keeps what it fetches, converts or remembers on this machine (standard library only:
the runtime asks for it at start-up, `edgefinfer.files.hashes`, and must not import torch to do so)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$EDGEFINFER_CACHE`, or `~/.cache/edgefinfer` when it is unset or empty."""
    root = os.environ.get("EDGEFINFER_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "edgefinfer"
