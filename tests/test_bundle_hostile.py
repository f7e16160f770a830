"""Bundles as untrusted input: a regression corpus of damaged and hostile manifests and files.

Every mutation of a good bundle must be refused by `load_manifest` with a one-line UserError, never a
traceback, a hang, or a read of a file outside the bundle; `edgefinfer run` on it exits 2 with one line."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys

import pytest

from edgefinfer.bundle.manifest import MANIFEST, BundleWriter, load_manifest
from edgefinfer.errors import UserError

PAYLOAD = b"weights" * 100
SHA = hashlib.sha256(PAYLOAD).hexdigest()


def good_bundle(dest):
    with BundleWriter(dest, target="gpu-server", model={"name": "tiny", "config": {}}) as w:
        (w.tmp / "model.gguf").write_bytes(PAYLOAD)
        w.add("model.gguf", format="gguf", role="model", backend="llamacpp", recipe="int8-g32")
        w.commit()
    return dest


def manifest_of(folder):
    return json.loads((folder / MANIFEST).read_text())


def art(m):
    return m["artefacts"][0]


def outside_file(tmp_path):
    """A file outside the bundle with the payload's exact size and sha256 (the attack of issue 17)."""
    f = tmp_path / "outside.gguf"
    f.write_bytes(PAYLOAD)
    return f


# (name, edit of the parsed manifest) -> each must be refused
MANIFEST_EDITS = {
    "list": lambda m, t: [],
    "null": lambda m, t: None,
    "string": lambda m, t: "manifest",
    "number": lambda m, t: 7,
    "no format": lambda m, t: {k: v for k, v in m.items() if k != "format"},
    "wrong format": lambda m, t: {**m, "format": "other"},
    "format is a number": lambda m, t: {**m, "format": 1},
    "format_version string": lambda m, t: {**m, "format_version": "1"},
    "format_version bool": lambda m, t: {**m, "format_version": True},
    "format_version 99": lambda m, t: {**m, "format_version": 99},
    "no target": lambda m, t: {k: v for k, v in m.items() if k != "target"},
    "target is a list": lambda m, t: {**m, "target": ["gpu-server"]},
    "model is a string": lambda m, t: {**m, "model": "tiny"},
    "no artefacts": lambda m, t: {k: v for k, v in m.items() if k != "artefacts"},
    "artefacts is an object": lambda m, t: {**m, "artefacts": {}},
    "artefact is a string": lambda m, t: {**m, "artefacts": ["model.gguf"]},
    "artefact is null": lambda m, t: {**m, "artefacts": [None]},
    "metrics is a list": lambda m, t: {**m, "metrics": []},
    "unknown top-level key": lambda m, t: {**m, "exec": "rm -rf /"},
    "unknown artefact key": lambda m, t: _art(m, evil=1),
    "artefact without path": lambda m, t: _art(m, path=None, drop="path"),
    "path is a number": lambda m, t: _art(m, path=3),
    "empty path": lambda m, t: _art(m, path=""),
    "parent path": lambda m, t: _art(m, path="../outside.gguf"),
    "parent inside path": lambda m, t: _art(m, path="sub/../../outside.gguf"),
    "absolute path": lambda m, t: _art(m, path=str(t / "outside.gguf")),
    "dot path": lambda m, t: _art(m, path="./model.gguf"),
    "double slash": lambda m, t: _art(m, path="sub//model.gguf"),
    "backslash path": lambda m, t: _art(m, path="..\\outside.gguf"),
    "windows drive": lambda m, t: _art(m, path="C:model.gguf"),
    "NUL in path": lambda m, t: _art(m, path="model.gguf\x00.txt"),
    "trailing slash": lambda m, t: _art(m, path="model.gguf/"),
    "size string": lambda m, t: _art(m, size="700"),
    "size negative": lambda m, t: _art(m, size=-1),
    "size float": lambda m, t: _art(m, size=700.0),
    "size bool": lambda m, t: _art(m, size=True),
    "size wrong": lambda m, t: _art(m, size=699),
    "sha256 short": lambda m, t: _art(m, sha256="abc"),
    "sha256 upper": lambda m, t: _art(m, sha256=SHA.upper()),
    "sha256 wrong": lambda m, t: _art(m, sha256="0" * 64),
    "sha256 null": lambda m, t: _art(m, sha256=None),
    "backend number": lambda m, t: _art(m, backend=5),
    "meta is a list": lambda m, t: _art(m, meta=[]),
    "listed twice": lambda m, t: {**m, "artefacts": [art(m), art(m)]},
    "missing file": lambda m, t: _art(m, path="absent.gguf"),
}


def _art(m, drop=None, **changes):
    m = copy.deepcopy(m)
    entry = art(m)
    entry.update(changes)
    if drop:
        del entry[drop]
    return m


# (name, edit of the bundle folder) -> each must be refused
FILE_EDITS = {
    "manifest not UTF-8": lambda b, t: (b / MANIFEST).write_bytes(b"\xff\xfe{}"),
    "manifest not JSON": lambda b, t: (b / MANIFEST).write_text("{not json"),
    "manifest empty": lambda b, t: (b / MANIFEST).write_text(""),
    "manifest nested 100000 deep": lambda b, t: (b / MANIFEST).write_text("[" * 100000 + "]" * 100000),
    "manifest 17 MiB": lambda b, t: (b / MANIFEST).write_bytes(b" " * (17 << 20)),
    "manifest is a folder": lambda b, t: ((b / MANIFEST).unlink(), (b / MANIFEST).mkdir()),
    "manifest symlink outside": lambda b, t: _symlink_manifest_outside(b, t),
    "model symlink outside": lambda b, t: ((b / "model.gguf").unlink(),
                                           (b / "model.gguf").symlink_to(outside_file(t))),
    "model is a FIFO": lambda b, t: ((b / "model.gguf").unlink(), os.mkfifo(b / "model.gguf")),
    "model is a folder": lambda b, t: ((b / "model.gguf").unlink(), (b / "model.gguf").mkdir()),
    "model truncated": lambda b, t: (b / "model.gguf").write_bytes(PAYLOAD[:-1]),
    "model changed": lambda b, t: (b / "model.gguf").write_bytes(b"X" + PAYLOAD[1:]),
    "model dangling symlink": lambda b, t: ((b / "model.gguf").unlink(), (b / "model.gguf").symlink_to(t / "nope")),
}


def _symlink_manifest_outside(b, t):
    real = t / "elsewhere.json"
    real.write_text((b / MANIFEST).read_text())
    (b / MANIFEST).unlink()
    (b / MANIFEST).symlink_to(real)


@pytest.mark.parametrize("name", list(MANIFEST_EDITS))
def test_hostile_manifest_is_refused_in_one_line(tmp_path, name):
    bundle = good_bundle(tmp_path / "b")
    outside_file(tmp_path)
    (bundle / MANIFEST).write_text(json.dumps(MANIFEST_EDITS[name](manifest_of(bundle), tmp_path)))
    with pytest.raises(UserError) as e:
        load_manifest(bundle)
    assert "\n" not in str(e.value) and str(e.value)


@pytest.mark.parametrize("name", list(FILE_EDITS))
def test_hostile_files_are_refused_in_one_line(tmp_path, name):
    bundle = good_bundle(tmp_path / "b")
    FILE_EDITS[name](bundle, tmp_path)
    with pytest.raises(UserError) as e:
        load_manifest(bundle)
    assert "\n" not in str(e.value) and str(e.value)


def test_corpus_size():
    assert len(MANIFEST_EDITS) + len(FILE_EDITS) >= 40


def test_the_attacks_of_issue_17_are_refused_for_what_they_are(tmp_path):
    """A path out of the bundle or a symlink to a file with the right size and sha256 was run."""
    bundle = good_bundle(tmp_path / "b")
    outside_file(tmp_path)
    for rel, reason in (("../outside.gguf", "normalised relative path"), (str(tmp_path / "outside.gguf"), "absolute")):
        (bundle / MANIFEST).write_text(json.dumps(_art(manifest_of(good_bundle(tmp_path / "b")), path=rel)))
        with pytest.raises(UserError, match=reason):
            load_manifest(bundle)
    bundle = good_bundle(tmp_path / "b")
    (bundle / "model.gguf").unlink()
    (bundle / "model.gguf").symlink_to(tmp_path / "outside.gguf")
    with pytest.raises(UserError, match="resolves outside the bundle"):
        load_manifest(bundle)


def test_a_symlink_inside_the_bundle_is_fine(tmp_path):
    bundle = good_bundle(tmp_path / "b")
    (bundle / "real.gguf").write_bytes(PAYLOAD)
    (bundle / "model.gguf").unlink()
    (bundle / "model.gguf").symlink_to("real.gguf")
    assert load_manifest(bundle).artefact("model").path == "model.gguf"


@pytest.mark.parametrize("name", ["null", "parent path", "sha256 upper"])
def test_cli_run_on_a_hostile_bundle_exits_2_in_one_line(tmp_path, name):
    bundle = good_bundle(tmp_path / "b")
    outside_file(tmp_path)
    (bundle / MANIFEST).write_text(json.dumps(MANIFEST_EDITS[name](manifest_of(bundle), tmp_path)))
    proc = subprocess.run([sys.executable, "-m", "edgefinfer", "run", str(bundle), "-p", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
