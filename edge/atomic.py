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


def user_mode(directory: bool = False) -> int:
    """The mode a plain `open()` / `mkdir()` would give under the current umask (0666 / 0777 & ~umask).

    Temporary files and folders (`mkstemp`, `mkdtemp`) are private (0600 / 0700); whatever is renamed
    into place from them gets this mode, so a bundle is as readable as any file the user writes."""
    umask = os.umask(0)  # the only portable way to read the umask is to set it; restore at once
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


@contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `dest`; on success it replaces `dest`, on failure it is removed."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        # mkdtemp makes the folder private (0700), and writers that go through temporary files (the
        # ExecuTorch cache, onnxruntime's quantizer) leave 0600 files: a model or bundle folder is meant
        # to be shared, so everything in it gets the mode the user's umask gives a new file.
        file_mode, dir_mode = user_mode(), user_mode(directory=True)
        for root, dirs, files in os.walk(tmp):
            for name in dirs:
                os.chmod(os.path.join(root, name), dir_mode)
            for name in files:
                os.chmod(os.path.join(root, name), file_mode)
        os.chmod(tmp, dir_mode)
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
