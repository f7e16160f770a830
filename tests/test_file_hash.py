"""A file's sha256 is computed once per version of the file (edgefinfer.files.hashes): a bundle's second load
does not read its weights to hash them, and any change to a file, even one that keeps its size, is
hashed again and refused."""

from __future__ import annotations

import os
import time

import pytest

from edgefinfer.files import hashes as file_hash, stamped
from edgefinfer.bundle.manifest import BundleWriter, load_manifest
from edgefinfer.errors import UserError


@pytest.fixture
def reads(monkeypatch, tmp_path):
    """The files sha256_file hashed (the store in a fresh cache; files count as settled at once)."""
    monkeypatch.setenv("EDGEFINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(stamped, "SETTLED_S", 0.0)
    seen: list[str] = []
    real = file_hash.sha256_file

    def counting(path, chunk=1 << 20):
        seen.append(os.path.basename(path))
        return real(path, chunk)

    monkeypatch.setattr(file_hash, "sha256_file", counting)
    return seen


def _bundle(root):
    src = root / "weights.bin"
    src.write_bytes(os.urandom(1 << 16))
    with BundleWriter(root / "bundle", "linux-x86_64", {}) as w:
        w.add_copy(src, "model.onnx", format="onnx", role="model", backend="onnxruntime")
        return w.commit()


def test_second_load_does_not_hash_again(reads, tmp_path):
    bundle = _bundle(tmp_path)
    load_manifest(bundle)
    assert reads == ["model.onnx"]
    load_manifest(bundle)
    assert reads == ["model.onnx"]  # the stamps matched: the weights were not read


def test_a_changed_file_is_hashed_again_and_refused(reads, tmp_path):
    bundle = _bundle(tmp_path)
    load_manifest(bundle)
    time.sleep(0.05)  # past the file system's timestamp tick (the real SETTLED_S covers this)
    path = bundle / "model.onnx"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    with open(path, "r+b") as f:  # the same inode and size, only one byte other
        f.write(data)
    with pytest.raises(UserError, match="does not match its sha256"):
        load_manifest(bundle)
    assert reads == ["model.onnx", "model.onnx"]


def test_a_fresh_file_is_not_remembered(monkeypatch, tmp_path):
    """A file changed less than SETTLED_S ago may still change within the same timestamp tick."""
    monkeypatch.setenv("EDGEFINFER_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 1000)
    assert file_hash.known_sha256(path) == file_hash.sha256_file(path)
    assert not (tmp_path / "cache" / file_hash.STORE).exists()


def test_a_damaged_store_is_ignored(reads, tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"y" * 1000)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / file_hash.STORE).write_text("{not json")
    first = file_hash.known_sha256(path)
    assert file_hash.known_sha256(path) == first
    assert reads == ["w.bin"]  # hashed once, stored over the damaged store, then taken from it
