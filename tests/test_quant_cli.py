"""`edgefinfer quantize` on a tiny model folder: the checkpoint, the report, and one-line errors."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from edgefinfer.app import cli as edge_cli
from edgefinfer.model.checkpoint import save_model
from edgefinfer.compile.quant.checkpoint import load_quantized
from edgefinfer.app.quantize_command import REPORT_FILE, parse_size, quantize
from edgefinfer.errors import UserError
from tests.helpers import tiny_model


@pytest.fixture
def run(monkeypatch):
    """`edgefinfer ARGS...` with this command wired in: returns (exit code, captured output)."""
    monkeypatch.setitem(edge_cli.cli.commands, "quantize", quantize)

    def _run(capsys, *args: str) -> tuple[int, str]:
        code = edge_cli.main(["quantize", *args])
        out = capsys.readouterr()
        return code, out.out + out.err

    return _run


@pytest.fixture
def tiny_dir(tmp_path):
    """A tiny model folder with a word-level tokenizer over its 97 ids."""
    folder = tmp_path / "tiny"
    save_model(tiny_model(intermediate_size=128), folder)
    words = "the a of and to in was her it he she that not be as for with had his you at by".split()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    vocab.update({f"w{i}": i for i in range(len(vocab), 97)})
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_quantize_writes_checkpoint_report_and_summary(run, capsys, tiny_dir, tmp_path):
    code, out = run(capsys, str(tiny_dir), "-r", "int4-gptq-g32", "-o", str(tmp_path / "q"), "--calib-blocks", "4",
                    "--calib-len", "32", "--eval-tokens", "256", "--window", "64", "--stride", "32")
    assert code == 0, out
    assert "[gptq] layer   2/2" in out and "int4-g32-asym" in out and "test ppl" in out
    report = json.loads((tmp_path / "q" / REPORT_FILE).read_text())
    for key in ("size_bytes", "float_size_bytes", "test_ppl", "float_test_ppl", "kl_to_float", "top1_agreement",
                "per_layer_bits", "quantize_seconds", "wall_seconds"):
        assert key in report, key
    assert report["per_layer_bits"]["model.layers.1.mlp.down_proj"] == "int4-g32-asym"
    assert report["size_bytes"] < report["float_size_bytes"] and 0 < report["top1_agreement"] <= 1
    model, recipe = load_quantized(tmp_path / "q")
    assert recipe.name == "int4-gptq-g32" and (tmp_path / "q" / "tokenizer.json").is_file()
    code, out = run(capsys, str(tmp_path / "q"), "-r", "int4-g32", "-o", str(tmp_path / "qq"))
    assert code == 2 and "is already quantized (recipe int4-gptq-g32)" in out


def test_mixed_precision_from_the_command_line(run, capsys, tiny_dir, tmp_path):
    code, out = run(capsys, str(tiny_dir), "-r", "int4-g64-sym", "-o", str(tmp_path / "m"), "--calib-blocks", "2",
                    "--calib-len", "32", "--eval-tokens", "0", "--mixed-budget", "int4-g32-sym",
                    "--mixed-unit", "linear")
    assert code == 0, out
    report = json.loads((tmp_path / "m" / REPORT_FILE).read_text())
    mixed = report["mixed_precision"]
    assert set(mixed["choice"].values()) <= {"int4-g64-sym", "int8-g32-sym"} and len(mixed["choice"]) == 14
    assert "KL int4-g64-sym" in out  # the sensitivity table


@pytest.mark.parametrize("args,message", [
    (["-r", "int3-magic"], "unknown recipe 'int3-magic'"),
    (["-r", "int4-g128"], "group size 128 does not divide the input dimension 64"),
    (["-r", "int4-gptq-g32", "--calib-blocks", "0"], "calibration set is empty"),
    (["-r", "int4-g32", "--mixed-budget", "1kb", "--calib-blocks", "1", "--calib-len", "16"], "below the smallest"),
    (["-r", "int4-g32", "--mixed-budget", "lots"], "cannot read the size 'lots'"),
    (["-r", "8da4w-g32-outliers4", "--calib-blocks", "0"], "picking the float outlier channels needs at least one"),
])
def test_bad_input_is_one_line_and_exit_code_2(run, capsys, tiny_dir, tmp_path, args, message):
    code, out = run(capsys, str(tiny_dir), "-o", str(tmp_path / "x"), "--eval-tokens", "0", *args)
    assert code == 2
    assert message in out and out.startswith("error: ") and out.count("\n") == 1, out
    assert not (tmp_path / "x").exists()


def test_outlier_channels_are_picked_on_the_calibration_text_and_kept_in_the_checkpoint(run, capsys, tiny_dir,
                                                                                        tmp_path):
    code, out = run(capsys, str(tiny_dir), "-r", "8da4w-g32-fzp-outliers4", "-o", str(tmp_path / "q"),
                    "--calib-blocks", "4", "--calib-len", "32", "--eval-tokens", "0")
    assert code == 0, out
    assert "[outliers] 4 float input channels in each of 14 linears" in out  # 2 layers x q, k, v, o, gate, up, down
    model, recipe = load_quantized(tmp_path / "q")
    assert recipe.outlier_channels == 4
    assert model.model.layers[1].mlp.down_proj.float_cols.numel() == 4 and model.lm_head.float_cols is None


def test_empty_calibration_text(run, capsys, tiny_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    code, out = run(capsys, str(tiny_dir), "-r", "int4-awq-g32", "-o", str(tmp_path / "x"), "--calib-text", str(empty))
    assert code == 2 and "calibration set is empty" in out


def test_parse_size():
    assert parse_size("85MB") == 85_000_000 and parse_size("1.5 MiB") == 1_572_864 and parse_size("123") == 123
    with pytest.raises(UserError):
        parse_size("-3MB")


def test_default_calibration_is_the_one_build_uses(monkeypatch):
    """16 blocks of 256 tokens of the mixed text, seed 0, as app/build.py's quantize_for."""
    import edgefinfer.data.corpora as data
    from edgefinfer.app.quantize_command import default_calibration

    defaults = {p.name: p.default for p in quantize.params}
    assert [defaults[k] for k in ("calib_split", "calib_blocks", "calib_len", "seed")] == ["calib-mix", 16, 256, 0]
    seen = []
    monkeypatch.setattr(data, "load_text", lambda split: seen.append(split) or "the a of " * 3000)

    class Words:
        encode = staticmethod(lambda text: list(range(len(text.split()))))

    assert tuple(default_calibration(Words()).shape) == (16, 256) and seen == ["calib-mix"]


@pytest.mark.parametrize("requantize", [False, True])
def test_a_source_ggufs_higher_bit_matrices_stay_at_8_bits_unless_told(run, capsys, tiny_dir, tmp_path, requantize):
    """As `edgefinfer build` does: a matrix the source GGUF stored at 6 bits is not cut to the recipe's 4."""
    types = {"model.layers.1.mlp.down_proj": "Q6_K", "model.layers.0.self_attn.q_proj": "Q4_K"}
    (tiny_dir / "source.json").write_text(json.dumps({"gguf_type": "q4_k_m", "tensor_types": types}))
    code, out = run(capsys, str(tiny_dir), "-r", "int4-g32", "-o", str(tmp_path / "q"), "--eval-tokens", "0",
                    *(["--requantize-source"] if requantize else []))
    assert code == 0, out
    report = json.loads((tmp_path / "q" / REPORT_FILE).read_text())
    bits = report["per_layer_bits"]
    assert bits["model.layers.0.self_attn.q_proj"] == "int4-g32-asym"
    assert bits["model.layers.1.mlp.down_proj"] == ("int4-g32-asym" if requantize else "int8-pc-sym")
    assert ("1 matrices stay at 8 bits" in out) != requantize
    model, recipe = load_quantized(tmp_path / "q")  # the checkpoint remembers the override
    assert model.get_submodule("model.layers.1.mlp.down_proj").fmt.bits == (4 if requantize else 8)


@pytest.mark.parametrize("target", [None, "gpu-server"])
def test_a_checkpoint_for_a_gguf_keeps_the_sources_matrices_in_gguf_types(run, capsys, tiny_dir, tmp_path, target):
    """`--target gpu-server` keeps a source GGUF's Q5_0 matrix as int5 and its Q6_K one as int8 in groups of
    32 (Q5_0, Q8_0), so the checkpoint builds into a GGUF; without it they are per-channel int8, and the
    build refuses before the export, saying how to re-quantize."""
    from edgefinfer.app.build import BuildOptions, _check_checkpoint_for_gguf, build
    from edgefinfer.bundle.recipe import Recipe
    from edgefinfer.bundle.targets import get_target

    types = {"model.layers.1.mlp.down_proj": "Q6_K", "model.layers.0.self_attn.q_proj": "Q5_0"}
    (tiny_dir / "source.json").write_text(json.dumps({"gguf_type": "q4_k_m", "tensor_types": types}))
    code, out = run(capsys, str(tiny_dir), "-r", "int4-g32", "-o", str(tmp_path / "q"), "--eval-tokens", "0",
                    *(["--target", target] if target else []))
    assert code == 0, out
    bits = json.loads((tmp_path / "q" / REPORT_FILE).read_text())["per_layer_bits"]
    assert (bits["model.layers.0.self_attn.q_proj"], bits["model.layers.1.mlp.down_proj"]) == (
        ("int5-g32-sym", "int8-g32-sym") if target else ("int8-pc-sym", "int8-pc-sym"))
    model, recipe = load_quantized(tmp_path / "q")
    if target:
        _check_checkpoint_for_gguf(model, Recipe.of(recipe), get_target("gpu-server"))
    else:  # what `edgefinfer build -t gpu-server` of this checkpoint says at its step 3
        with pytest.raises(UserError, match=r"(q_proj|down_proj)\.weight is int8-pc-sym.*quantize \.\.\. --target gpu-server") as e:
            build(BuildOptions(target="gpu-server", model=tmp_path / "q", out=tmp_path / "b", eval_tokens=0))
        assert "\n" not in str(e.value) and not (tmp_path / "b").exists()


def test_an_unknown_target_fails_before_any_work(run, capsys, tiny_dir, tmp_path):
    code, out = run(capsys, str(tiny_dir), "-r", "int4-g32", "-o", str(tmp_path / "q"), "--target", "toaster")
    assert code == 2 and "toaster" in out and not (tmp_path / "q").exists()


def test_a_k_quant_checkpoint_builds_for_a_gguf_and_is_refused_elsewhere(run, capsys, tiny_dir, tmp_path):
    """-k: only rows that are whole super-blocks (the 256-wide down projections) become Q4_K, the rest
    Q4_1's groups, each with its GGUF type; for another target the build refuses such a checkpoint in
    one line (its float32 super-block scales are GGUF's layout) before writing anything. (The GGUF
    build itself: tests/test_gguf_export.py, with a tokenizer GGUF takes.)"""
    from edgefinfer.app.build import BuildOptions, build
    from edgefinfer.compile.gguf_export import quantized_gguf_types

    import shutil

    wide = tmp_path / "wide"
    save_model(tiny_model(intermediate_size=256), wide)  # 256-wide MLP inputs, the same tokenizer
    shutil.copy(tiny_dir / "tokenizer.json", wide / "tokenizer.json")
    code, out = run(capsys, str(wide), "-r", "int4-g32-fzp-k", "-o", str(tmp_path / "q"), "--eval-tokens", "0")
    assert code == 0, out
    bits = json.loads((tmp_path / "q" / REPORT_FILE).read_text())["per_layer_bits"]
    assert (bits["model.layers.0.mlp.down_proj"], bits["model.layers.0.mlp.up_proj"]) == ("int4-g32-fzp-k256",
                                                                                          "int4-g32-fzp")
    types = quantized_gguf_types(load_quantized(tmp_path / "q")[0])  # what a gpu-server build writes
    assert (types["model.layers.0.mlp.down_proj"], types["model.layers.0.mlp.up_proj"]) == ("Q4_K", "Q4_1")
    with pytest.raises(UserError, match=r"down_proj holds K-quant super-blocks.*re-quantize it without -k") as e:
        build(BuildOptions(target="linux-x86_64", model=tmp_path / "q", out=tmp_path / "onnx", eval_tokens=0))
    assert "\n" not in str(e.value) and not (tmp_path / "onnx").exists()
