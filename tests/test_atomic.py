"""Writes that survive crashes (issue 17, item 5): `atomic_dir` fsyncs before it swaps, swaps an existing
destination in one step, cleans what dead writers left, turns a full disk into one line; a build
killed with SIGKILL leaves the old bundle or the new one, never a broken or missing one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgefinfer import atomic
from edgefinfer.atomic import atomic_dir, remove_leftovers
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
