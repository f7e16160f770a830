"""Bundles: atomic writes, hash verification, one-line refusals."""

import json

import pytest

from edgefinfer.bundle.manifest import BundleWriter, load_manifest
from edgefinfer.errors import UserError


def make_bundle(dest, payload=b"weights" * 100):
    with BundleWriter(dest, target="android", model={"name": "tiny", "config": {}}) as w:
        (w.tmp / "model.bin").write_bytes(payload)
        w.add("model.bin", format="pte", role="model", backend="executorch", recipe="fp32", kv={"kind": "static"})
        w.manifest.metrics["ppl"] = 12.5
        w.commit()
    return dest


def test_round_trip(tmp_path):
    m = load_manifest(make_bundle(tmp_path / "b"), target="android")
    art = m.artefact("model")
    assert art.backend == "executorch" and art.size == 700 and art.meta == {"kv": {"kind": "static"}}
    assert m.metrics["ppl"] == 12.5 and m.tools["torch"]


def test_failure_leaves_nothing(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with BundleWriter(tmp_path / "b", target="android", model={}) as w:
            (w.tmp / "model.bin").write_bytes(b"x")
            1 / 0
    assert list(tmp_path.iterdir()) == []


def test_failure_keeps_the_previous_bundle(tmp_path):
    make_bundle(tmp_path / "b", b"old")
    with pytest.raises(KeyboardInterrupt):
        with BundleWriter(tmp_path / "b", target="android", model={}):
            raise KeyboardInterrupt
    assert (tmp_path / "b" / "model.bin").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


@pytest.mark.parametrize("damage, message", [
    (lambda f: f.write_bytes(f.read_bytes()[:-1]), "has 699 bytes, the manifest says 700"),
    (lambda f: f.write_bytes(b"X" + f.read_bytes()[1:]), "does not match its sha256"),
    (lambda f: f.unlink(), "is missing model.bin"),
])
def test_damaged_bundles_are_refused(tmp_path, damage, message):
    damage(make_bundle(tmp_path / "b") / "model.bin")
    with pytest.raises(UserError, match=message):
        load_manifest(tmp_path / "b")


def test_wrong_target_and_bad_manifests(tmp_path):
    b = make_bundle(tmp_path / "b")
    with pytest.raises(UserError, match="built for target 'android', not 'ios'"):
        load_manifest(b, target="ios")
    raw = json.loads((b / "manifest.json").read_text())
    (b / "manifest.json").write_text(json.dumps({**raw, "format_version": 99}))
    with pytest.raises(UserError, match="format version 99 is not supported"):
        load_manifest(b)
    (b / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="malformed"):
        load_manifest(b)
    with pytest.raises(UserError, match="does not exist"):
        load_manifest(tmp_path / "nope")
