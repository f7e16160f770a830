"""`edgefinfer build`: bundles per target, run by their runtimes; missing SDKs fail fast; an
interrupted or killed build leaves nothing at the destination and a rerun succeeds."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from edgefinfer.bundle.manifest import load_manifest
from edgefinfer.model.checkpoint import save_model
from edgefinfer.errors import UserError
from edgefinfer.runtime.engine import Engine
from edgefinfer.tokenization.tokenizer import Tokenizer
from tests.helpers import tiny_model, tiny_tokenizer

TINY_TEXT = "It is a truth universally acknowledged, 12 naïve café ✓ 你好.\n  <|im_start|>user\nhi<|im_end|>"


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "edgefinfer", *args], capture_output=True, text=True,
                          timeout=900, **kw)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("build") / "tiny"
    tok = tiny_tokenizer(320)
    tok.eos_token = None  # a random model would stop at a random EOS; the streaming test needs 1100 tokens
    save_model(tiny_model(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                          max_position_embeddings=1024, eos_token_id=None), folder)
    tok.save(folder)
    return folder


def test_missing_vendor_sdk_fails_in_under_a_second():
    t0 = time.perf_counter()
    proc = cli("build", "--target", "mediatek")
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "mtk_converter" in proc.stderr
    assert elapsed < 1.0 + 2.0  # the check itself; the slack covers the interpreter's start on a busy box


def test_unknown_target(tmp_path):
    proc = cli("build", "--target", "symbian")
    assert proc.returncode == 2 and "unknown target 'symbian'" in proc.stderr


@pytest.mark.parametrize("target, artefact", [("gpu-server", "model.gguf"), ("linux-x86_64", "model.onnx")])
def test_bundle_runs_in_its_runtime(tmp_path, tiny_dir, target, artefact):
    proc = cli("build", "--target", target, "--model", str(tiny_dir), "-o", str(tmp_path / "b"),
               "--eval-tokens", "256")
    assert proc.returncode == 0, proc.stderr
    assert "vs float" in proc.stdout  # the summary table
    manifest = load_manifest(tmp_path / "b", target=target)
    art = manifest.artefact("model")
    assert art.path == artefact and art.size > 0 and len(art.sha256) == 64
    assert manifest.metrics["ppl"] > 0 and abs(manifest.metrics["ppl_delta_pct"]) < 10
    assert manifest.tools["torch"] and manifest.recipe["name"]
    engine = Engine.load(tmp_path / "b")
    out = engine.generate("It is a truth", max_tokens=12)
    assert out.stats.generated_tokens == 12
    if target == "gpu-server":  # llama.cpp splits with the GGUF's vocabulary, as tokenizer.json would
        ours = Tokenizer.from_dir(tiny_dir)
        assert engine.tokenizer.encode(TINY_TEXT) == ours.encode(TINY_TEXT)
        assert engine.tokenizer.decode(out.token_ids) == ours.decode(out.token_ids) == out.text
        assert engine.tokenizer._backend is None  # tokenizer.json was never parsed


def test_quality_budget_takes_the_smallest_recipe_its_runtime_confirms(tmp_path, tiny_dir):
    """gpu-server candidates, smallest first: Q4_0 costs this model +4% (eager), over a 2% budget;
    asymmetric int4 (Q4_1) is within it, is compiled, and llama.cpp's own measurement confirms it."""
    proc = cli("build", "--target", "gpu-server", "--model", str(tiny_dir), "-o", str(tmp_path / "b"),
               "--eval-tokens", "256", "--quality-budget", "2")
    assert proc.returncode == 0, proc.stderr
    manifest = load_manifest(tmp_path / "b", target="gpu-server")
    tried = {c["recipe"]: c for c in manifest.recipe["candidates"]}
    assert list(tried) == ["int4-g32-sym", "int4-g32"]
    assert tried["int4-g32-sym"]["eager_ppl_delta"] > 2 and "runtime_ppl_delta" not in tried["int4-g32-sym"]
    assert manifest.recipe["name"] == "int4-g32" and manifest.recipe["quality_budget_pct"] == 2
    art = manifest.artefact("model")
    assert art.meta["gguf_type"] == "q4_1" and set(art.meta["tensor_types"]) == {"Q4_1", "Q8_0", "F32"}
    assert manifest.metrics["ppl_delta_pct"] <= 2
    assert tried["int4-g32"]["runtime_ppl_delta"] == round(manifest.metrics["ppl_delta_pct"], 3)


def test_quality_budget_skips_candidates_that_cannot_apply(tmp_path, tiny_dir):
    """android: int4 groups of 128 do not divide this model's 64-wide layers: skipped, reason printed;
    the next candidate is quantized as the exporter does, compiled, and measured by ExecuTorch."""
    proc = cli("build", "--target", "android", "--model", str(tiny_dir), "-o", str(tmp_path / "b"),
               "--eval-tokens", "128", "--max-seq-len", "128", "--quality-budget", "50")
    assert proc.returncode == 0, proc.stderr
    assert "8da4w-g128-emb4        skipped: group size 128 does not divide the input dimension 64" in proc.stderr
    manifest = load_manifest(tmp_path / "b", target="android")
    first, chosen = manifest.recipe["candidates"]
    assert first["recipe"] == "8da4w-g128-emb4" and "group size 128" in first["skipped"]
    assert chosen["recipe"] == manifest.recipe["name"] == "8da4w-g32-emb4"
    assert abs(chosen["runtime_ppl_delta"] - chosen["eager_ppl_delta"]) < 0.5  # the .pte computes the eager model
    assert manifest.metrics["ppl_delta_pct"] <= 50


def test_8da8w_candidate_is_measured_quantized(tiny_dir):
    """quantize_for used to hand 8da8w back in float (scored +0%): now it is quantized (int8 per-channel
    weights, int8 dynamic activations, int8 per-row embeddings and tied head), which export_pte takes
    as it is, so the eager figure is the .pte's."""
    import torch

    from edgefinfer.app.build import quantize_for
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.bundle.recipe import Recipe
    from edgefinfer.compile.executorch_export import resolve_options
    from edgefinfer.compile.quant.modules import QuantEmbedding, QuantLinear
    from edgefinfer.bundle.targets import get_target

    model = load_model(tiny_dir)
    quantized = quantize_for(model, get_target("android"), Recipe.parse("8da8w"), None)
    formats = {(type(m).__name__, m.fmt.label(), getattr(m, "act_quant", None)) for m in quantized.modules()
               if isinstance(m, (QuantLinear, QuantEmbedding))}
    assert formats == {("QuantLinear", "int8-pc-sym", True), ("QuantEmbedding", "int8-pc-sym", None)}
    ids = torch.arange(40)[None] % model.config.vocab_size
    with torch.no_grad():
        assert not torch.equal(quantized(ids), model(ids))
    opts = resolve_options(quantized, recipe="8da8w")
    assert opts.prequantized and opts.scheme == "8da8w"  # export_pte takes these codes as they are


def test_llamacpp_quantizer_candidate_is_scored_on_the_file_it_writes(tmp_path, tiny_dir, monkeypatch):
    """llamacpp-q4_1 (llama.cpp's own rounding, float block minimum): the candidate is scored on the
    written file read back, and llama.cpp's measurement of the shipped file agrees with that score."""
    from edgefinfer.app import build as build_mod

    monkeypatch.setitem(build_mod.CANDIDATES, "gguf", ["int4-g32-sym", "llamacpp-q4_1"])
    build_mod.build(build_mod.BuildOptions(target="gpu-server", model=tiny_dir, out=tmp_path / "b", eval_tokens=256,
                                           quality_budget=3.8))
    manifest = load_manifest(tmp_path / "b", target="gpu-server")
    first, chosen = manifest.recipe["candidates"]
    assert first["eager_ppl_delta"] > 3.8 and chosen["recipe"] == manifest.recipe["name"] == "llamacpp-q4_1"
    assert abs(chosen["runtime_ppl_delta"] - chosen["eager_ppl_delta"]) < 0.5
    art = manifest.artefact("model")
    assert art.meta["gguf_type"] == "q4_1" and art.meta["tensor_types"]["Q4_1"] >= 14
    assert chosen["size_bytes"] == art.size


def test_quality_budget_nobody_meets_fails_naming_the_best(tmp_path, tiny_dir, monkeypatch):
    """Without a float candidate to fall back on, a budget no quantized recipe meets is a one-line error
    naming the best candidate and its figure; nothing is written."""
    from edgefinfer.app import build as build_mod

    monkeypatch.setitem(build_mod.CANDIDATES, "gguf", ["int4-g64-sym", "int4-g32-sym-emb4", "int4-g32-sym"])
    dest = tmp_path / "b"
    with pytest.raises(UserError) as e:
        build_mod.build(build_mod.BuildOptions(target="gpu-server", model=tiny_dir, out=dest, eval_tokens=256,
                                               quality_budget=1))
    assert re.fullmatch(r"no recipe for gpu-server stays within \+1% perplexity: the best, int4-g32-sym, reached "
                        r"\+4\.\d\d% \(eager\); raise --quality-budget or pass --recipe", str(e.value)), str(e.value)
    assert not dest.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, message", [
    (("--quality-budget", "-1"), "--quality-budget is a perplexity increase in percent, >= 0; got -1"),
    (("--quality-budget", "5", "--recipe", "int8"), "give --recipe or --quality-budget, not both"),
    (("--quality-budget", "5", "--eval-tokens", "0"), "--quality-budget needs an evaluation"),
    (("--recipe", "int4-g64"), "int4-g64-asym, which has no exact GGUF type"),
    (("--recipe", "int8"), "is int8-pc-sym, which has no exact GGUF type"),
    (("--recipe", "llamacpp-q5"), "llama.cpp's quantizer makes GGUF files (gpu-server), with llamacpp-q4_0, llamacpp-q4_1"),
])
def test_bad_budgets_and_recipes_without_a_gguf_type_fail_in_one_line(tmp_path, tiny_dir, args, message):
    proc = cli("build", "--target", "gpu-server", "--model", str(tiny_dir), "-o", str(tmp_path / "b"),
               "--eval-tokens", "64", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 or "[build" in proc.stderr  # progress lines, then one error line
    assert "Traceback" not in proc.stderr and not (tmp_path / "b").exists()


@pytest.mark.parametrize("target, kv, sinks", [("linux-x86_64", "window:64", None),
                                               ("android", "window:64,sinks:4", 4)])
def test_window_bundle_streams_past_the_models_context(tmp_path, tiny_dir, target, kv, sinks):
    """`--kv window:N`: ONNX Runtime's windowed GQA cache or ExecuTorch's ring (with attention
    sinks); either streams past the model's 1024 positions."""
    proc = cli("build", "--target", target, "--model", str(tiny_dir), "-o", str(tmp_path / "b"),
               "--kv", kv, "--eval-tokens", "128")
    assert proc.returncode == 0, proc.stderr
    meta = load_manifest(tmp_path / "b").artefact("model").meta["kv"]
    assert (meta["layout"], meta["window"], meta["max_seq_len"], meta.get("num_sinks")) == ("window", 64, None, sinks)
    out = Engine.load(tmp_path / "b").generate("It is a truth", max_tokens=1100)
    assert out.stats.generated_tokens == 1100


@pytest.mark.parametrize("target, kv, message", [
    ("gpu-server", "window:64", "keeps a full KV cache"),
    ("linux-x86_64", "window:64,sinks:4", "keeps no attention sinks"),
    ("android", "paged:16", "chosen when running"),
    ("android", "ring:3", "bad --kv 'ring:3'"),
])
def test_cache_layouts_a_target_cannot_have_fail_up_front(target, kv, message):
    proc = cli("build", "--target", target, "--kv", kv)
    assert proc.returncode == 2 and message in proc.stderr
    assert proc.stderr.strip().count("\n") == 0  # one line, no traceback


def test_ios_builds_a_core_ml_delegated_pte(tmp_path, tiny_dir):
    from edgefinfer.compile.executorch_export import pte_delegates

    proc = cli("build", "--target", "ios", "--model", str(tiny_dir), "-o", str(tmp_path / "ios"),
               "--max-seq-len", "64")
    assert proc.returncode == 0, proc.stderr
    manifest = load_manifest(tmp_path / "ios", target="ios")
    info = pte_delegates(tmp_path / "ios" / manifest.artefact("model").path)
    assert "CoreMLBackend" in json.dumps(info)
    assert "ppl" not in manifest.metrics  # cannot run on this host: nothing claimed


@pytest.mark.reference
@pytest.mark.llamacpp
def test_quality_budget_on_the_reference_model(tmp_path, smollm2_dir):
    """SmolLM2 for gpu-server within +22%: Q4_0 from symmetric codes costs ~+25% (eager) and is passed
    over; Q4_1 from asymmetric codes (~+19%) is within, is written, and llama.cpp's own measurement
    of that file confirms it. (SmolLM2 ships as Q4_1 with a float minimum; our integer zero points
    cannot sit on that grid, hence the large 4-bit figures of round-to-nearest.)"""
    proc = cli("build", "--target", "gpu-server", "--model", str(smollm2_dir), "-o", str(tmp_path / "b"),
               "--eval-tokens", "512", "--quality-budget", "22")
    assert proc.returncode == 0, proc.stderr
    manifest = load_manifest(tmp_path / "b", target="gpu-server")
    first, chosen = manifest.recipe["candidates"]
    assert first["recipe"] == "int4-g32-sym" and first["eager_ppl_delta"] > 22
    assert chosen["recipe"] == manifest.recipe["name"] == "int4-g32"
    assert manifest.artefact("model").meta["gguf_type"] == "q4_1"
    assert abs(chosen["runtime_ppl_delta"] - chosen["eager_ppl_delta"]) < 1.0  # the file computes our model
    assert manifest.metrics["ppl_delta_pct"] <= 22


@pytest.mark.reference
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_build_leaves_no_bundle_and_rerun_succeeds(tmp_path, smollm2_dir, sig):
    dest = tmp_path / "dist" / "gpu"
    # Our own GGUF writer (Q8_0): its compile step lasts seconds, so the signal lands inside it.
    args = [sys.executable, "-m", "edgefinfer", "build", "--target", "gpu-server", "--model", str(smollm2_dir),
            "-o", str(dest), "--eval-tokens", "256", "--recipe", "int8-g32-emb8"]
    # A test run started in the background (`cmd &`) inherits SIGINT ignored, and Python then installs
    # no KeyboardInterrupt handler: give the build the disposition a terminal would.
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stderr:  # wait until the bundle's temporary folder is being filled
        if line.startswith("[build 4/5]"):
            break
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    assert proc.returncode == (130 if sig == signal.SIGINT else -9)  # Ctrl-C: "interrupted", exit 130
    assert not dest.exists()
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr
    assert load_manifest(dest, target="gpu-server").metrics["ppl_delta_pct"] < 2.0
    assert [p.name for p in dest.parent.iterdir()] == ["gpu"]  # the killed build's temporary folder is gone


@pytest.mark.llamacpp
@pytest.mark.parametrize("fit", [False, True])
def test_a_gguf_from_our_recipe_keeps_the_source_ggufs_types(tmp_path, tiny_dir, fit):
    """Gemma 3 270M's case: a model converted from a Q4_K_M file (Q5_0, Q6_K and Q8_0 beside Q4_K) built
    for gpu-server with one of our recipes. Its kept matrices go into types a GGUF holds (Q5_0 as Q5_0,
    Q6_K as Q6_K where its rows are whole super-blocks of 256, else Q8_0 as llama.cpp falls back; these
    are 128 wide), checked before the quantization; per-channel int8 had no GGUF type and failed the build
    after it. --fit-source-size takes the largest type no larger than the source's for a type our writer
    lacks: Q5_1 as Q5_0."""
    import shutil

    from edgefinfer.app import build as build_mod
    from edgefinfer.model.gguf_import import open_gguf

    folder = tmp_path / "from-gguf"
    shutil.copytree(tiny_dir, folder)
    types = {"model.layers.0.mlp.down_proj": "Q5_1", "model.layers.0.self_attn.q_proj": "Q5_0",
             "model.layers.1.self_attn.q_proj": "Q4_K", "model.layers.1.mlp.down_proj": "Q8_0",
             "model.layers.1.mlp.up_proj": "Q6_K"}
    (folder / "source.json").write_text(json.dumps({"gguf_type": "q4_k_m", "tensor_types": types}))
    bundle = build_mod.build(build_mod.BuildOptions(target="gpu-server", model=folder, out=tmp_path / "b",
                                                    eval_tokens=0, recipe="int4-g32-fzp", fit_source_size=fit))
    written = {t.name: t.tensor_type.name for t in open_gguf(bundle / "model.gguf").reader.tensors}
    q5_1_as = "Q5_0" if fit else "Q8_0"
    assert (written["blk.0.attn_q.weight"], written["blk.0.ffn_down.weight"]) == ("Q5_0", q5_1_as)
    assert written["blk.1.ffn_down.weight"] == "Q8_0"  # no type of ours is smaller and holds 8 bits
    assert written["blk.1.ffn_up.weight"] == "Q8_0"  # Q6_K's fallback: 64-wide rows are no super-block
    assert written["blk.1.attn_q.weight"] == written["blk.0.attn_k.weight"] == "Q4_1"  # the recipe's
    kept = load_manifest(bundle, target="gpu-server").recipe["source_precision"]
    assert {n: (f["bits"], f["group_size"]) for n, f in kept.items()} == {
        "model.layers.0.mlp.down_proj": (5 if fit else 8, 32), "model.layers.0.self_attn.q_proj": (5, 32),
        "model.layers.1.mlp.down_proj": (8, 32), "model.layers.1.mlp.up_proj": (8, 32)}


@pytest.mark.parametrize("target, requantize", [("linux-x86_64", False), ("gpu-server", True)])
def test_fit_source_size_is_refused_without_a_gguf_or_with_requantize(tmp_path, target, requantize):
    from edgefinfer.app import build as build_mod

    with pytest.raises(UserError, match="--fit-source-size .* needs a GGUF target"):
        build_mod.build(build_mod.BuildOptions(target=target, out=tmp_path / "b", fit_source_size=True,
                                               requantize_source=requantize))
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("target", ["linux-x86_64", "android"])
def test_k_quant_recipes_are_refused_outside_a_gguf_before_any_work(tmp_path, tiny_dir, target):
    from edgefinfer.app import build as build_mod

    with pytest.raises(UserError, match="-k super-blocks are GGUF's K-quants .*drop -k") as e:
        build_mod.build(build_mod.BuildOptions(target=target, model=tiny_dir, out=tmp_path / "b", eval_tokens=0,
                                               recipe="int4-g32-fzp-k"))
    assert "\n" not in str(e.value) and not (tmp_path / "b").exists()


@pytest.mark.parametrize("requantize", [False, True])
def test_an_explicit_recipe_keeps_the_source_ggufs_higher_bits_unless_told(tmp_path, tiny_dir, requantize):
    """A model converted from a GGUF keeps at 8 bits the matrices the GGUF stored above the recipe's bits,
    with --recipe as with the default; --requantize-source takes the recipe literally."""
    import shutil

    from edgefinfer.app import build as build_mod

    folder = tmp_path / "from-gguf"
    shutil.copytree(tiny_dir, folder)
    types = {"model.layers.0.mlp.down_proj": "Q6_K", "model.layers.0.self_attn.q_proj": "Q4_K"}
    (folder / "source.json").write_text(json.dumps({"gguf_type": "q4_k_m", "tensor_types": types}))
    build_mod.build(build_mod.BuildOptions(target="linux-x86_64", model=folder, out=tmp_path / "b", eval_tokens=0,
                                           recipe="int4-g32-fzp", requantize_source=requantize))
    kept = load_manifest(tmp_path / "b", target="linux-x86_64").recipe.get("source_precision", {})
    assert list(kept) == ([] if requantize else ["model.layers.0.mlp.down_proj"])
