"""The command line: help lists the pipeline; user errors are one line with exit code 2, no traceback."""

import subprocess
import sys

import pytest

from edgefinfer.model.checkpoint import save_model
from tests.helpers import tiny_model, tiny_tokenizer


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgefinfer", *args], capture_output=True, text=True,
                          timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_help_lists_the_whole_pipeline():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("pull", "eval", "generate", "distill", "prune", "quantize", "build", "run", "serve", "bench"):
        assert f"  {command}" in proc.stdout


def test_unknown_option():
    assert_one_line_error(run_cli("generate", "--frobnicate", "-p", "x"), "No such option", "--frobnicate")


def test_missing_model_folder(tmp_path):
    assert_one_line_error(run_cli("generate", str(tmp_path / "missing"), "-p", "hi"), "missing")


def test_truncated_checkpoint(tmp_path):
    save_model(tiny_model(), tmp_path / "m", tokenizer_dir=None)
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    tiny_tokenizer().save(tmp_path / "m")
    assert_one_line_error(run_cli("generate", str(tmp_path / "m"), "-p", "hi"), "truncated or corrupt")


def test_generate_on_a_tiny_folder(tmp_path):
    tok = tiny_tokenizer()
    save_model(tiny_model(vocab_size=tok.vocab_size, eos_token_id=None), tmp_path / "m")
    tok.save(tmp_path / "m")
    proc = run_cli("generate", str(tmp_path / "m"), "-p", "It is a truth", "-n", "8", "--no-stream")
    assert proc.returncode == 0, proc.stderr
    assert "8 generated" in proc.stderr


@pytest.mark.parametrize("command", ["serve", "run", "build"])
def test_commands_refuse_a_bogus_argument_in_one_line(command):
    # Not built yet: says so; once built: a missing bundle/model is a user error all the same.
    assert_one_line_error(run_cli(command, "/nonexistent/whatever"))


def test_structured_output_flags_constrain_and_bad_constraints_fail_in_one_line(tmp_path):
    import json
    import re

    tok = tiny_tokenizer()
    save_model(tiny_model(vocab_size=tok.vocab_size, eos_token_id=None), tmp_path / "m")
    tok.save(tmp_path / "m")
    model = str(tmp_path / "m")
    proc = run_cli("generate", model, "-p", "It is a truth", "-n", "30", "--no-stream", "--regex", "[a-z]{4}-[0-9]{2}")
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"[a-z]{4}-[0-9]{2}", proc.stdout.strip()) and "finish=stop" in proc.stderr
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    proc = run_cli("generate", model, "-p", "x", "-n", "20", "--no-stream", "--json-schema", str(schema))
    assert proc.returncode == 0 and json.loads(proc.stdout) in ({"ok": True}, {"ok": False}), proc.stdout
    # (grammars, and each kind of bad constraint, are tested without a process: tests/test_structured.py)
    assert_one_line_error(run_cli("generate", model, "-p", "x", "--regex", "(open"), "regex does not compile")
    assert_one_line_error(run_cli("generate", model, "-p", "x", "--regex", "a", "--grammar", str(tmp_path / "g.lark")),
                          "exclude each other")
