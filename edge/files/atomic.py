"""Write a file or a folder completely or not at all: build it beside its destination, then rename it
into place. The one atomic writer of the package:

    with atomic_dir(dest) as tmp: ...        # a model folder or bundle: fill tmp/
    with atomic_file(dest) as tmp: ...       # a file a library writes by path (torch.save, GGUFWriter)
    write_bytes(dest, data); copy_file(src, dest)

Used by every writer of a file or folder a crash must not tear, so that an interrupted write (Ctrl-C,
SIGKILL, a power cut, a full disk) leaves the destination either as it was or complete, never half-written:

* every file and folder of the new tree is fsync'ed before the swap, and the parent after it, so the
  rename is never made durable before the data it points at (ext4/xfs may reorder otherwise);
* on Linux an existing destination is replaced with one `renameat2(RENAME_EXCHANGE)`: there is no
  moment without a destination. Elsewhere (or on a file system without it) it falls back to two
  renames, old out then new in; a kill between them leaves `.NAME.old-PID` beside a missing NAME;
* what is renamed into place gets the mode the user's umask gives a new file or folder, not the
  0600 / 0700 of the temporary it was written as;
* leftovers of a writer that died (`.NAME.tmp-PID-*`, `.NAME.old-PID`, the PID no longer running) are
  removed by the next write to the same destination;
* a full disk (ENOSPC, EDQUOT, EFBIG, also when a library wrapped it) becomes one UserError line.

Torch-free: the runtime loads bundles without torch.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from edgefinfer.errors import UserError


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
    remove_leftovers(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent))
    try:
        yield tmp
        _share(tmp)
        _fsync_tree(tmp)
        _swap_into_place(tmp, dest)
    except BaseException as e:
        _remove(tmp)
        _raise_if_disk_full(e, dest)
        raise


@contextmanager
def atomic_file(dest: Path, *, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `dest` (an empty file); on success it replaces `dest`, on failure
    it is removed and `dest` is left as it was.

    durable: fsync the file before the rename and the folder after it; False for files that can be made
    again (a cache entry checked on read), where the fsyncs would only cost time."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(dest)
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, user_mode())  # mkstemp's 0600 would hide the file from everyone else
        if durable:
            _fsync(tmp)
        os.replace(tmp, dest)
        if durable:
            _fsync(dest.parent)
    except BaseException as e:
        _remove(tmp)
        _raise_if_disk_full(e, dest)
        raise


def write_bytes(dest: Path, data: bytes | memoryview, *, durable: bool = True) -> None:
    """`dest` holds `data` completely, or is left as it was."""
    with atomic_file(dest, durable=durable) as tmp, open(tmp, "wb") as f:
        f.write(data)


def copy_file(src: Path, dest: Path, *, durable: bool = True) -> None:
    """`dest` becomes a copy of `src` completely, or is left as it was."""
    with atomic_file(dest, durable=durable) as tmp:
        shutil.copyfile(src, tmp)


def _share(tmp: Path) -> None:
    """mkdtemp makes the folder private (0700), and writers that go through temporary files (the
    ExecuTorch cache, onnxruntime's quantizer) leave 0600 files: a model or bundle folder is meant to be
    shared, so everything in it gets the mode the user's umask gives a new file."""
    file_mode, dir_mode = user_mode(), user_mode(directory=True)
    for root, dirs, files in os.walk(tmp):
        for name in dirs:
            os.chmod(os.path.join(root, name), dir_mode)
        for name in files:
            os.chmod(os.path.join(root, name), file_mode)
    os.chmod(tmp, dir_mode)


def _fsync_tree(tmp: Path) -> None:
    for root, dirs, files in os.walk(tmp, topdown=False):  # children before the folder naming them
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # a folder cannot be fsync'ed on some systems (Windows, some network mounts)
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


def _swap_into_place(tmp: Path, dest: Path) -> None:
    replaced = None
    if dest.exists() or dest.is_symlink():
        if _exchange(tmp, dest):  # dest is now the new tree, tmp the old one
            replaced = tmp
        else:
            replaced = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, replaced)
            os.replace(tmp, dest)
    else:
        os.replace(tmp, dest)
    _fsync(dest.parent)
    if replaced is not None:
        _remove(replaced)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2); False where the system or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:  # glibc < 2.28, musl
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def remove_leftovers(dest: Path) -> list[Path]:
    """Remove what writers to `dest` that are no longer running left beside it; returns what was removed."""
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.(?:tmp-(\d+)-.+|old-(\d+))")
    removed = []
    for path in dest.parent.iterdir():
        m = pattern.fullmatch(path.name)
        if m and not _running(int(m.group(1) or m.group(2))):
            _remove(path)
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():  # this process may be writing it right now (another thread)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# numpy's tofile (gguf-py's tensor writer) reports a short write without an errno
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")


def _raise_if_disk_full(exc: BaseException, dest: Path) -> None:
    full = _disk_full(exc)
    if full is not None:
        raise UserError(f"no space left to write {dest} ({full.strerror or full}); {dest.name} was left as it was: "
                        f"free some space and run again") from None


def _disk_full(exc: BaseException | None) -> OSError | None:
    """The full-disk OSError behind `exc`, also when a library re-raised it as something else."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and (exc.errno in _FULL or exc.errno is None and _SHORT_WRITE.search(str(exc))):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
