"""`edgefinfer.bundle.resolve`: one answer to "what is this MODEL path" for the Engine, the server and the commands."""

import json

import pytest

from edgefinfer.bundle.manifest import BundleWriter
from edgefinfer.errors import UserError
from edgefinfer.bundle.resolve import resolve
from edgefinfer.server_gpu.loader import _resolve as serve_source


@pytest.fixture
def paths(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    onnx = tmp_path / "onnx"
    onnx.mkdir()
    (onnx / "model.onnx").write_bytes(b"x")
    for name in ("m.pte", "m.gguf", "m.onnx", "m.bin"):
        (tmp_path / name).write_bytes(b"x")
    with BundleWriter(tmp_path / "bundle", target="android", model={"name": "tiny", "config": {}}) as w:
        (w.tmp / "model.pte").write_bytes(b"pte")
        w.add("model.pte", format="pte", role="model", backend="executorch", recipe="8da4w-g32",
              kv={"layout": "window", "max_seq_len": None, "window": 64, "num_sinks": 4, "lookahead": 64})
        (w.tmp / "model.gguf").write_bytes(b"gguf")
        w.add("model.gguf", format="gguf", role="model", backend="llamacpp", recipe="int4-g32-sym")
        w.commit()
    return tmp_path


@pytest.mark.parametrize("rel, kind, backend", [
    ("m.pte", "artefact", "executorch"), ("m.gguf", "artefact", "llamacpp"), ("m.onnx", "artefact", "onnxruntime"),
    ("onnx", "artefact", "onnxruntime"), ("hf", "checkpoint", "torch"), ("bundle", "bundle", "executorch"),
    ("bundle/manifest.json", "bundle", "executorch")])
def test_each_kind_of_path(paths, rel, kind, backend):
    src = resolve(paths / rel)
    assert (src.kind, src.backend) == (kind, backend)


def test_a_bundle_gives_its_entry_and_typed_description(paths):
    src = resolve(paths / "bundle")
    assert (src.path, src.folder, src.name) == (paths / "bundle" / "model.pte", paths / "bundle", "tiny")
    assert (src.spec.format, src.spec.kv.window, src.spec.kv.sinks, src.spec.recipe.weights.bits) == ("pte", 64, 4, 4)
    assert src.eos_ids is None  # the manifest's config names none
    gguf = resolve(paths / "bundle", format="gguf")
    assert (gguf.path.name, gguf.backend, gguf.spec.recipe_name) == ("model.gguf", "llamacpp", "int4-g32-sym")
    assert resolve(paths / "bundle", "llamacpp").path.name == "model.gguf"
    with pytest.raises(UserError, match="bundle .* has no model artefact for backend 'onnxruntime'"):
        resolve(paths / "bundle", "onnxruntime")


def test_config_eos_and_errors(paths):
    assert resolve(paths / "hf").eos_ids == (2, 3)
    assert resolve(paths / "m.gguf").eos_ids is None  # a GGUF carries its own
    with pytest.raises(UserError, match=r"cannot tell what .*m\.bin is: expected a bundle folder"):
        resolve(paths / "m.bin")
    with pytest.raises(UserError, match="nothing does not exist: give a bundle folder"):
        resolve(paths / "nothing", names="checkpoint")  # a path, not a name: no reference lookup
    with pytest.raises(UserError, match="'no-such-model' is neither a model path nor a known model"):
        resolve("no-such-model", names="gguf")


def test_the_server_takes_a_gguf_or_a_hf_folder(paths):
    hf = serve_source(str(paths / "hf"))
    assert (hf.kind, hf.is_gguf, hf.folder, hf.eos_ids) == ("checkpoint", False, paths / "hf", (2, 3))
    bundle = serve_source(str(paths / "bundle"))
    assert (bundle.is_gguf, bundle.path.name, bundle.name, bundle.eos_ids) == (True, "model.gguf", "tiny", None)
    with pytest.raises(UserError, match="is not a .gguf file"):
        serve_source(str(paths / "m.pte"))
