"""The artefact description (`edgefinfer.bundle.artefact`): one writer and one reader per carrier, and the
exporters and runtimes meeting through them."""

import pytest

from edgefinfer.bundle.artefact import ArtefactSpec, KVSpec, read_spec, write_spec
from edgefinfer.compile.onnx_export import export_onnx
from edgefinfer.compile.onnx_graph import read_metadata
from edgefinfer.compile.onnx_static import export_static_decode
from edgefinfer.errors import UserError
from edgefinfer.runtime.backends.ort import OrtBackend, OrtStaticBackend
from tests.helpers import tiny_model

SPECS = [
    ArtefactSpec("onnx", KVSpec("static", max_seq_len=64), recipe_name="int4-g32-sym-emb4", vocab_size=256,
                 num_layers=2),
    ArtefactSpec("onnx", KVSpec("window", window=8, slots=10, lookahead=2), recipe_name="fp32", vocab_size=256,
                 num_layers=2),
    ArtefactSpec("onnx-static", KVSpec("window", max_seq_len=64, window=8, slots=7, max_chunk=4), vocab_size=256,
                 num_layers=2),
]


@pytest.mark.parametrize("spec", SPECS, ids=["gqa-static", "gqa-window", "ring"])
def test_onnx_metadata_round_trips(spec):
    stored = write_spec(spec, "onnx")
    assert all(k.startswith("edgefinfer.") and isinstance(v, str) for k, v in stored.items())
    assert read_spec("onnx", stored) == spec


@pytest.mark.parametrize("kv", [KVSpec("static", max_seq_len=128, sinks=0, max_chunk=128),
                                KVSpec("window", window=16, sinks=4, lookahead=16, max_chunk=17)])
def test_pte_methods_round_trip(kv):
    spec = ArtefactSpec("pte", kv, vocab_size=300, num_layers=2, all_logits=True, bos_id=None, eos_ids=(5, 7))
    methods = write_spec(spec, "pte")
    # ExecuTorch's runners read these: a window cache reports an unbounded context, -1 = no BOS.
    assert (methods["get_max_seq_len"], methods["get_bos_id"]) == (kv.max_chunk, -1)
    assert methods["get_max_context_len"] == (1 << 30 if kv.streams else 128)
    assert read_spec("pte", methods) == spec


def test_manifest_entry_round_trips_and_omits_what_the_format_lacks():
    onnx = ArtefactSpec("onnx", KVSpec("window", window=8, lookahead=2), recipe_name="int8",
                        inputs=("input_ids",), outputs=("logits",))
    meta = write_spec(onnx, "manifest")
    assert meta["kv"] == {"layout": "window", "max_seq_len": None, "window": 8, "lookahead": 2}  # no sinks key
    back = read_spec("manifest", meta)
    assert (back.format, back.kv, back.recipe_name, back.inputs) == ("onnx", onnx.kv, "int8", ("input_ids",))
    assert back.recipe.weights.bits == 8  # the typed recipe
    assert ArtefactSpec("pte", recipe_name="qdq-a16w8").recipe is None  # outside the quantizer's grammar
    with pytest.raises(UserError, match="kv entry is malformed"):
        read_spec("manifest", {"format": "pte", "kv": {"layout": "ring"}})


def test_older_onnx_metadata_still_reads():
    """Exports before the shared writer stored unset values as "" and no layout on the ring graph."""
    old_gqa = {"edgefinfer.graph": "gqa", "edgefinfer.kv": "static", "edgefinfer.max_seq_len": "64",
               "edgefinfer.window": "", "edgefinfer.cache_slots": "", "edgefinfer.weights": "fp32"}
    assert read_spec("onnx", old_gqa).kv == KVSpec("static", max_seq_len=64)
    old_ring = {"edgefinfer.graph": "static-decode", "edgefinfer.window": "8", "edgefinfer.cache_slots": "7",
                "edgefinfer.chunk": "1", "edgefinfer.max_seq_len": "64"}
    assert read_spec("onnx", old_ring).kv == KVSpec("window", max_seq_len=64, window=8, slots=7, max_chunk=1)
    assert read_spec("onnx", {}).format == "onnx"  # onnxruntime-genai's builder writes none of ours
    with pytest.raises(UserError, match="unknown edgefinfer ONNX graph kind 'npu-v2'"):
        read_spec("onnx", {"edgefinfer.graph": "npu-v2"})


def test_exporters_and_ort_backends_meet_through_the_description(tmp_path):
    model = tiny_model(vocab_size=256, max_position_embeddings=64)
    meta = export_onnx(model, tmp_path / "w", kv="window", window=8, lookahead=4)
    backend = OrtBackend(tmp_path / "w")
    assert backend.artefact == read_spec("onnx", read_metadata(tmp_path / "w" / "model.onnx"))
    assert backend.artefact.kv == KVSpec("window", window=8, slots=12, lookahead=4)
    assert meta["kv"] == write_spec(backend.artefact, "manifest")["kv"]
    export_static_decode(model, tmp_path / "s" / "model.onnx", cache_slots=7)
    ring = OrtStaticBackend(tmp_path / "s")
    assert (ring.window, ring.max_seq_len, ring.graphs[0].artefact.format) == (8, 64, "onnx-static")
