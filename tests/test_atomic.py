"""Writes that survive crashes (issue 17, item 5): `atomic_dir` fsyncs before it swaps, swaps an existing
destination in one step, cleans what dead writers left, turns a full disk into one line; a build
killed with SIGKILL leaves the old bundle or the new one, never a broken or missing one. `atomic_file`
(issue 33 item 3) does the same for single files, with the mode the user's umask gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgefinfer.files import atomic
from edgefinfer.files.atomic import atomic_dir, atomic_file, copy_file, remove_leftovers, write_bytes
from edgefinfer.errors import UserError
from tests.files_harness import build_old_bundle, disk_full_trial, kill9_trials, make_tiny_model_dir


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write(dest: Path, text: str) -> None:
    with atomic_dir(dest) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.txt").write_text(text)


def test_replacing_a_folder_leaves_only_the_new_one(tmp_path):
    dest = tmp_path / "b"
    _write(dest, "old")
    _write(dest, "new")
    assert (dest / "sub" / "a.txt").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


def test_without_an_atomic_exchange_the_two_renames_still_replace(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # macOS, or a file system without it
    dest = tmp_path / "b"
    _write(dest, "old")
    _write(dest, "new")
    assert (dest / "sub" / "a.txt").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["b"]


def test_every_file_and_folder_is_fsynced_before_the_swap_and_the_parent_after(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(atomic, "_fsync", lambda p: events.append(("fsync", Path(p))))
    real_swap = atomic._swap_into_place
    monkeypatch.setattr(atomic, "_swap_into_place", lambda t, d: (events.append(("swap", t)), real_swap(t, d)))
    dest = tmp_path / "b"
    with atomic_dir(dest) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.txt").write_text("x")
        (tmp / "m.json").write_text("{}")
    swap = events.index(("swap", tmp))
    synced_before = {p for kind, p in events[:swap]}
    assert synced_before == {tmp, tmp / "sub", tmp / "sub" / "a.txt", tmp / "m.json"}
    assert ("fsync", tmp_path) in events[swap:]  # the rename itself made durable


def test_leftovers_of_dead_writers_are_removed_by_the_next_write(tmp_path):
    dest = tmp_path / "b"
    _write(dest, "old")
    dead, alive = _dead_pid(), os.getppid()
    for name in (f".b.old-{dead}", f".b.tmp-{dead}-x1y2", f".b.tmp-{alive}-busy", ".other.old-1", ".b.tmp-abc"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    (tmp_path / f".b.old-{dead}x").write_text("not ours")
    _write(dest, "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["b", f".b.tmp-{alive}-busy", ".other.old-1", ".b.tmp-abc", f".b.old-{dead}x"])
    assert remove_leftovers(tmp_path / "other") == []  # PID 1 runs


def test_a_failed_write_leaves_the_destination_and_no_temporary_folder(tmp_path):
    dest = tmp_path / "b"
    _write(dest, "old")
    with pytest.raises(ZeroDivisionError):
        with atomic_dir(dest) as tmp:
            (tmp / "half").write_text("x")
            1 / 0
    assert (dest / "sub" / "a.txt").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["b"]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), OSError("8704 requested and 1024 written")])
def test_a_full_disk_is_one_line_and_the_destination_is_kept(tmp_path, error):
    dest = tmp_path / "b"
    _write(dest, "old")
    with pytest.raises(UserError, match=r"^no space left to write .*b was left as it was"):
        with atomic_dir(dest):
            try:
                raise error
            except OSError as e:  # a library that wraps the OSError (safetensors, torch) still counts
                raise RuntimeError("write failed") from e
    assert (dest / "sub" / "a.txt").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["b"]


@pytest.fixture(scope="module")
def old_bundle(tmp_path_factory) -> tuple[Path, Path, float]:
    """(model folder, a gpu-server bundle of it, seconds its build took)."""
    work = tmp_path_factory.mktemp("atomic")
    model_dir = make_tiny_model_dir(work / "tiny")
    return model_dir, work / "old", build_old_bundle(model_dir, work / "old")


def test_a_build_on_a_full_disk_exits_in_one_line_and_keeps_the_old_bundle(tmp_path, old_bundle):
    model_dir, old, _ = old_bundle
    out = disk_full_trial(tmp_path, model_dir, old)
    assert out["exit_code"] == 2 and not out["traceback"] and out["error_lines"] == 1, out
    assert out["last_line"].startswith("error: no space left to write"), out
    assert out["previous_bundle"] == "old" and out["previous_manifest_unchanged"] and out["leftovers"] == []


def test_builds_killed_at_random_moments_leave_the_old_or_the_new_bundle(tmp_path, old_bundle):
    out = kill9_trials(tmp_path, *old_bundle, trials=2, seed=1)
    assert out["bad_destinations"] == 0, out
    assert out["kill9"]["leftovers_after_next_write"] == []


# ---- files (issue 33 item 3): one writer for every file a crash must not tear -----------------------------

@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_a_written_file_gets_the_mode_the_umask_gives(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_bytes(tmp_path / "a.bin", b"data")
        copy_file(tmp_path / "a.bin", tmp_path / "sub" / "b.bin")
        with atomic_file(tmp_path / "c.bin") as tmp:  # a library writing by path (torch.save, GGUFWriter)
            tmp.write_bytes(b"data")
    finally:
        os.umask(old)
    for name in ("a.bin", "sub/b.bin", "c.bin"):
        assert (tmp_path / name).read_bytes() == b"data"
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name  # not mkstemp's 0600


def test_a_failure_mid_write_leaves_the_old_file_and_no_temporary(tmp_path):
    dest = tmp_path / "model.bin"
    write_bytes(dest, b"old contents")
    with pytest.raises(ZeroDivisionError):
        with atomic_file(dest) as tmp:
            tmp.write_bytes(b"half of the new")
            1 / 0
    assert dest.read_bytes() == b"old contents" and [p.name for p in tmp_path.iterdir()] == ["model.bin"]


def test_a_file_write_on_a_full_disk_is_one_line_and_keeps_the_old_file(tmp_path):
    dest = tmp_path / "model.bin"
    write_bytes(dest, b"old")
    with pytest.raises(UserError, match=r"^no space left to write .*model.bin was left as it was"):
        with atomic_file(dest):
            raise OSError(28, "No space left on device")
    assert dest.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["model.bin"]


def test_a_file_is_fsynced_before_the_rename_and_its_folder_after(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(atomic, "_fsync", lambda p: events.append(("fsync", Path(p))))
    real_replace = os.replace
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: (events.append(("rename", Path(b))), real_replace(a, b)))
    write_bytes(tmp_path / "a.bin", b"x")
    [(kind0, tmp), rename, folder] = events
    assert kind0 == "fsync" and tmp.name.startswith(".a.bin.tmp-") and rename == ("rename", tmp_path / "a.bin")
    assert folder == ("fsync", tmp_path)


def test_a_temporary_file_of_a_dead_writer_is_removed_by_the_next_write(tmp_path):
    stale = tmp_path / f".a.bin.tmp-{_dead_pid()}-abc"
    stale.write_bytes(b"torn")
    write_bytes(tmp_path / "a.bin", b"x")
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]


def test_a_killed_file_write_leaves_the_old_file(tmp_path):
    """SIGKILL in the middle of a large write: the destination is the old file, whole."""
    dest = tmp_path / "big.bin"
    write_bytes(dest, b"old" * 1000)
    code = ("import os, signal, sys\nfrom pathlib import Path\nfrom edgefinfer.files.atomic import atomic_file\n"
            f"with atomic_file(Path({str(dest)!r})) as tmp, open(tmp, 'wb') as f:\n"
            "    f.write(b'new' * 100000); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -9
    assert dest.read_bytes() == b"old" * 1000
    write_bytes(dest, b"new")  # the next write clears what the killed one left
    assert [p.name for p in tmp_path.iterdir()] == ["big.bin"]
