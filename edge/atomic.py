"""Write a folder completely or not at all: build it beside its destination, then rename it into place.

Used by every writer of a model folder or bundle, so that an interrupted write (Ctrl-C, a kill, a
full disk) never leaves a half-written destination. Torch-free: the runtime loads bundles without torch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `dest`; on success it replaces `dest`, on failure it is removed."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        # mkdtemp makes the folder private (0700); a model or bundle folder is meant to be shared.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
