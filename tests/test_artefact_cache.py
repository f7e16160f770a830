"""The artefact cache (issue 30 item 2): one content-keyed store for every target's expensive step
(lowering, ONNX emission, QNN context binaries, quantization, the float score). A
damaged entry (bytes flipped, truncated, torn metadata) is discarded with one line and rebuilt; an
interrupted write leaves nothing a lookup reads; an unwritable or full cache warns once and the export
still succeeds; a second build of the same bundle reuses the entry and says so."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgefinfer.bundle.manifest import load_manifest
from edgefinfer.model.checkpoint import save_model
from edgefinfer.compile import artefact_cache
from edgefinfer.compile.artefact_cache import ENTRY_FILE, ArtefactCache, cached_figures, content_key
from edgefinfer.compile.onnx_export import CACHE_SOURCES, export_onnx
from edgefinfer.files.user_cache import cache_dir
from edgefinfer.data.corpora import load_text
from tests.helpers import tiny_model, tiny_tokenizer

KIND = "onnx"


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_position_embeddings=64)


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("[cache]")]


def _export(model, out: Path, root: Path, **kw):
    return export_onnx(model, out, max_seq_len=64, cache_dir=root, **kw)


def _entry_dir(root: Path, meta: dict) -> Path:
    return root / KIND / meta["cache_key"]


def _files(folder: Path, names) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for n in names}


def test_the_same_export_is_reused_byte_for_byte(model, tmp_path, capsys):
    first = _export(model, tmp_path / "a", tmp_path / "c")
    again = _export(model, tmp_path / "b", tmp_path / "c")
    assert not first["cached"] and again["cached"] and again["cache_key"] == first["cache_key"]
    assert _files(tmp_path / "a", first["files"]) == _files(tmp_path / "b", first["files"])
    assert {k: v for k, v in again.items() if k != "cached"} == {k: v for k, v in first.items() if k != "cached"}
    [line] = _lines(capsys)
    assert line.startswith(f"[cache] reused onnx {first['cache_key'][:12]}")


def test_the_key_follows_weights_options_and_exporter_source(model, tmp_path):
    opts = {"max_seq_len": 64}
    key = content_key(KIND, model, opts, CACHE_SOURCES)
    assert content_key(KIND, model, opts, CACHE_SOURCES) == key
    assert content_key(KIND, model, {"max_seq_len": 32}, CACHE_SOURCES) != key
    assert content_key("executorch", model, opts, CACHE_SOURCES) != key
    other = tiny_model(seed=1, max_position_embeddings=64)
    assert content_key(KIND, other, opts, CACHE_SOURCES) != key
    edited = tmp_path / "exporter.py"
    edited.write_bytes(Path(CACHE_SOURCES[0]).read_bytes() + b"\n# edited\n")
    assert content_key(KIND, model, opts, (edited, *CACHE_SOURCES[1:])) != key


def test_the_key_follows_module_settings_that_are_not_tensors():
    """Two quantized models with the same codes differ in what their linears do with activations (int8,
    split in two rows): the programs differ, so must the keys (a split program was once served as the
    unsplit one's)."""
    import copy

    from edgefinfer.compile.quant.apply import quantize_model
    from edgefinfer.compile.quant.modules import QuantLinear
    from edgefinfer.compile.quant.recipe import parse_recipe

    quantized = tiny_model()
    quantize_model(quantized, parse_recipe("8da4w-g32-fzp"))
    split = copy.deepcopy(quantized)
    for module in split.modules():
        if isinstance(module, QuantLinear):
            module.act_split = 8
    opts = {"max_seq_len": 64}
    assert content_key(KIND, split, opts, CACHE_SOURCES) != content_key(KIND, quantized, opts, CACHE_SOURCES)


def test_the_executorch_key_covers_the_code_it_traces():
    """An ExecuTorch program is a trace of the model's forward and of the modules the quantizer's layouts
    swap in (OffsetLinear): an edit to either must miss the cache (it once reused a stale program)."""
    pytest.importorskip("executorch")
    from edgefinfer.compile import executorch_export
    from edgefinfer.compile.quant import layouts
    from edgefinfer.model import transformer

    sources = {Path(p).resolve() for p in executorch_export.CACHE_SOURCES}
    assert {Path(layouts.__file__).resolve(), Path(transformer.__file__).resolve()} <= sources


@pytest.mark.parametrize("damage", ["flip", "truncate", "entry_json"])
def test_a_damaged_entry_is_discarded_in_one_line_and_rebuilt(model, tmp_path, capsys, damage):
    root = tmp_path / "c"
    first = _export(model, tmp_path / "a", root)
    entry = _entry_dir(root, first)
    data = entry / first["model_file"] if damage != "entry_json" else entry / ENTRY_FILE
    raw = bytearray(data.read_bytes())
    if damage == "flip":  # same size: only the sha256 can tell
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    else:  # a copy cut short, or metadata torn mid-write
        data.write_bytes(bytes(raw[: len(raw) // 2]))
    capsys.readouterr()
    again = _export(model, tmp_path / "b", root)
    assert not again["cached"]  # built again, not copied from the damaged entry
    [line] = _lines(capsys)
    assert line.startswith(f"[cache] discarded the damaged onnx entry {first['cache_key'][:12]}")
    assert _files(tmp_path / "a", first["files"]) == _files(tmp_path / "b", first["files"])
    assert _export(model, tmp_path / "c2", root)["cached"]  # the rebuilt entry is whole again


def test_an_interrupted_write_leaves_no_entry_that_is_read(model, tmp_path, monkeypatch):
    root = tmp_path / "c"
    cache = ArtefactCache(root)
    src = tmp_path / "f.bin"
    src.write_bytes(b"x" * 4096)

    def killed(path):
        raise KeyboardInterrupt  # Ctrl-C after the first file was copied in

    monkeypatch.setattr(artefact_cache, "_sha256", killed)
    with pytest.raises(KeyboardInterrupt):
        cache.put(KIND, "k" * 40, {"f.bin": src}, {})
    monkeypatch.undo()
    assert cache.get(KIND, "k" * 40) is None
    assert list((root / KIND).iterdir()) == []  # nor a temporary beside where it would be


def test_a_temporary_of_a_killed_writer_is_never_read(tmp_path):
    root = tmp_path / "c"
    cache = ArtefactCache(root)
    src = tmp_path / "f.bin"
    src.write_bytes(b"x" * 4096)
    assert cache.put(KIND, "a" * 40, {"f.bin": src}, {"n": 1})
    killed = root / KIND / f".{'b' * 40}.tmp-999999-x"  # what a SIGKILL mid-put leaves
    (root / KIND / ("a" * 40)).rename(killed)
    assert cache.get(KIND, "b" * 40) is None and cache.get(KIND, "a" * 40) is None


def _unwritable_under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("not a folder")
    return tmp_path / "file" / "cache"


def _unwritable_read_only(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder; the path-under-a-file case covers this")
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    return root


@pytest.mark.parametrize("make_root", [_unwritable_under_a_file, _unwritable_read_only])
def test_an_unwritable_cache_warns_once_and_the_export_succeeds(model, tmp_path, capsys, make_root):
    root = make_root(tmp_path)
    try:
        first = _export(model, tmp_path / "a", root)
        again = _export(model, tmp_path / "b", root)
    finally:
        if root.is_dir():
            root.chmod(0o700)  # so that pytest can remove it
    assert not first["cached"] and not again["cached"]
    assert (tmp_path / "b" / first["model_file"]).stat().st_size > 0
    lines = _lines(capsys)
    [line] = lines  # once per process, however many steps open the cache
    assert line.startswith("[cache] warning: cannot write the artefact cache")


def test_a_full_disk_disables_the_cache_with_one_warning(tmp_path, capsys, monkeypatch):
    def full(src, dest, durable=True):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(artefact_cache, "copy_file", full)
    src = tmp_path / "f.bin"
    src.write_bytes(b"x")
    assert not ArtefactCache(tmp_path / "c").put(KIND, "a" * 40, {"f.bin": src}, {})
    assert not ArtefactCache(tmp_path / "c").put(KIND, "b" * 40, {"f.bin": src}, {})  # no second try, no second line
    [line] = _lines(capsys)
    assert "no space left" in line and "going on without it" in line
    assert [p.name for p in (tmp_path / "c" / KIND).iterdir()] == []


def test_a_second_build_of_the_same_bundle_reuses_the_cache_and_says_so(tmp_path):
    tok = tiny_tokenizer(320)
    save_model(tiny_model(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                          max_position_embeddings=256), tmp_path / "tiny")
    tok.save(tmp_path / "tiny")
    load_text("test")  # the corpus, in the user's cache: shared below, so only the artefacts start empty
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "data").symlink_to(cache_dir() / "data", target_is_directory=True)
    env = {**os.environ, "EDGEFINFER_CACHE": str(tmp_path / "cache")}
    runs = []
    for out in ("b1", "b2"):
        proc = subprocess.run([sys.executable, "-m", "edgefinfer", "build", "--target", "linux-x86_64", "--model",
                               str(tmp_path / "tiny"), "-o", str(tmp_path / out), "--eval-tokens", "128",
                               "--max-seq-len", "128"], capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr
        runs.append(proc.stderr)
    assert "reused the artefact cache" not in runs[0]
    reused = [line for line in runs[1].splitlines() if line.endswith("(reused the artefact cache)")]
    assert [line.split(" done in ")[0] for line in reused] == [  # the float score and the ONNX graph
        "[build 2/5] float perplexity (eager torch)", "[build 4/5] compile onnx for linux-x86_64 (int4-g32-fzp)"]
    assert "[cache] reused the quantized model" in runs[1]  # and the quantized weights the graph was keyed on
    first, second = (load_manifest(tmp_path / b, target="linux-x86_64") for b in ("b1", "b2"))
    assert first.artefact("model").sha256 == second.artefact("model").sha256
    assert first.metrics["ppl"] == pytest.approx(second.metrics["ppl"])
    assert json.loads((tmp_path / "b2" / "genai_config.json").read_text()) == \
        json.loads((tmp_path / "b1" / "genai_config.json").read_text())


def test_a_metadata_only_entry_is_checked_too(model, tmp_path, capsys):
    """A measurement (the build's float perplexity) has no files: its entry.json's own sha256 guards it."""
    calls = []

    def score():
        calls.append(1)
        return {"ppl": 12.5}

    opts, sources = {"window": 8}, CACHE_SOURCES[:1]
    assert cached_figures("float-ppl", model, opts, sources, score, tmp_path) == ({"ppl": 12.5}, False)
    assert cached_figures("float-ppl", model, opts, sources, score, tmp_path) == ({"ppl": 12.5}, True)
    [entry] = (tmp_path / "float-ppl").iterdir()
    record = entry / ENTRY_FILE
    record.write_text(record.read_text().replace("12.5", "13.5"))  # still valid JSON, another figure
    assert cached_figures("float-ppl", model, opts, sources, score, tmp_path) == ({"ppl": 12.5}, False)
    assert len(calls) == 2 and "metadata's sha256 differs" in _lines(capsys)[0]
