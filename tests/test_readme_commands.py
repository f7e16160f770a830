"""Every `edgefinfer ...` line in README.md's code blocks parses with the real command line (issue 30).

Only click's parser runs (`make_context`, no callback): an unknown option, a missing required argument or
a value of the wrong type fails the test naming the README line. Nothing is loaded, nothing is fetched.
Optional parts written `[...]` are checked both ways: the plain line, and each alternative (`A | B`,
`a|b|c`) filled in, nested groups too, so every `--flag` the README shows must exist.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import click
import pytest

from edgefinfer.app.cli import cli

README = Path(__file__).resolve().parent.parent / "README.md"

# Placeholders the README writes in capitals; the rest (MODEL, OUT, DIR, FILE, RE, "...") are fine as text.
PLACEHOLDERS = {"PCT": "5", "N": "4", "K": "4", "R": "int4-g32"}


def readme_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) for each `edgefinfer ...` line inside ``` fences. Lines ending with `\\` and
    the indented lines that follow a command (its optional parts) are joined to it."""
    commands: list[tuple[int, str]] = []
    in_fence, current, start, continued = False, None, 0, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if current is not None:
                commands.append((start, current))
            in_fence, current, continued = not in_fence, None, False
            continue
        if not in_fence:
            continue
        body = _strip_comment(line).rstrip()
        if current is not None and (continued or (line[:1].isspace() and body.strip())):
            current += " " + body.strip().rstrip("\\").strip()
            continued = body.endswith("\\")
            continue
        if current is not None:
            commands.append((start, current))
            current = None
        if line.startswith("edgefinfer "):
            current, start, continued = body.rstrip("\\").strip(), number, body.endswith("\\")
    if current is not None:
        commands.append((start, current))
    return commands


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a `#` outside quotes, after a space or at the start)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _groups(text: str) -> list[tuple[int, int]]:
    """Spans (start, end exclusive) of the top-level [...] groups."""
    spans, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ] in {text!r}")
            if depth == 0:
                spans.append((start, i + 1))
    if depth:
        raise ValueError(f"unbalanced [ in {text!r}")
    return spans


def _alternatives(inner: str) -> list[str]:
    """`--a X | --b Y` -> both; `--kv A | B` and `--backend a|b` -> `--kv A`, `--kv B`, `--backend a`, ...:
    an alternative without its own option takes the first alternative's."""
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(inner):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "|" and depth == 0:
            parts.append(inner[last:i].strip())
            last = i + 1
    parts.append(inner[last:].strip())
    flag = parts[0].split()[0] if parts[0].startswith("-") else ""
    return [p if p.startswith("-") or not flag else f"{flag} {p}" for p in parts]


def _join(pieces: list[str]) -> str:
    return re.sub(r"\s+", " ", "".join(pieces)).strip()


def variants(text: str) -> list[str]:
    """The plain form (every optional group dropped), then each alternative of each group filled in."""
    spans = _groups(text)

    def without(keep: int | None = None, fill: str = "") -> str:
        pieces, pos = [], 0
        for n, (a, b) in enumerate(spans):
            pieces += [text[pos:a], fill if n == keep else ""]
            pos = b
        return _join(pieces + [text[pos:]])

    out = [without()]
    for n, (a, b) in enumerate(spans):
        for alt in _alternatives(text[a + 1:b - 1]):
            out += [without(n, sub) for sub in variants(alt)]
    return list(dict.fromkeys(out))


def parse_only(command: str) -> None:
    """Parse `edgefinfer ...` with the real CLI, running nothing; raises click.UsageError on bad input."""
    argv = [PLACEHOLDERS.get(a, a) for a in shlex.split(command)]
    assert argv[0] == "edgefinfer", command
    with cli.make_context("edgefinfer", argv[1:2], resilient_parsing=False) as group_ctx:
        name, cmd, rest = cli.resolve_command(group_ctx, argv[1:])
        assert cmd is not None, f"no command {name!r}"
        with cmd.make_context(name, rest, parent=group_ctx, resilient_parsing=False):
            pass


COMMANDS = readme_commands(README.read_text(encoding="utf-8"))


def test_the_readme_shows_the_pipeline_commands():
    names = {shlex.split(c)[1] for _, c in COMMANDS}
    assert {"pull", "eval", "generate", "prune", "distill", "quantize", "targets", "build", "run", "serve"} <= names


@pytest.mark.parametrize("number, command", COMMANDS, ids=[f"README.md:{n}" for n, _ in COMMANDS])
def test_readme_command_parses(number, command):
    for variant in variants(command):
        try:
            parse_only(variant)
        except click.UsageError as e:
            pytest.fail(f"README.md line {number}: {command}\n  as `{variant}`: {e.format_message()}")


def test_variants_cover_every_alternative():
    v = variants("edgefinfer build --target android [--recipe R] [--max-seq-len 1024 | --kv window:512[,sinks:4]]"
                 " [--backend a|b]")
    assert v == ["edgefinfer build --target android",
                 "edgefinfer build --target android --recipe R",
                 "edgefinfer build --target android --max-seq-len 1024",
                 "edgefinfer build --target android --kv window:512",
                 "edgefinfer build --target android --kv window:512,sinks:4",
                 "edgefinfer build --target android --backend a",
                 "edgefinfer build --target android --backend b"]
    text = "```\nedgefinfer run X -p \"a # b\" \\\n    [--regex RE]   # note\n    [--grammar FILE]\nother\n```\n"
    assert readme_commands(text) == [(2, 'edgefinfer run X -p "a # b" [--regex RE] [--grammar FILE]')]


@pytest.mark.parametrize("command", [
    "edgefinfer prune MODEL --method wanda --sparsity 0.5 -o OUT",  # what the README once said
    "edgefinfer distill --teacher MODEL --student DIR -o OUT",
    "edgefinfer quantize MODEL --recipe int4-awq-g64",  # -o is required
    "edgefinfer build --target android --quality-budget PCTX",
    "edgefinfer nosuchcommand",
])
def test_wrong_lines_are_caught(command):
    with pytest.raises(click.UsageError):
        parse_only(command)


# ------------------------------------- issue 30 too: in CI a missing dev dependency fails (tests/conftest.py)
pytest_plugins = ["pytester"]

_SKIPS = '''
import pytest

def test_missing_inside():
    pytest.importorskip("edgefinfer_no_such_module")

@pytest.fixture
def needs_missing():
    pytest.importorskip("edgefinfer_no_such_module")

def test_missing_in_fixture(needs_missing):
    pass

@pytest.mark.skipif(True, reason="needs a GPU")
def test_no_gpu():
    pass

@pytest.mark.skipif(True, reason="needs onnxruntime-qnn")  # fails in CI only where it is missing
def test_named_dependency():
    pass

@pytest.mark.xfail(reason="could not import 'x'")
def test_xfail():
    assert False
'''


@pytest.mark.parametrize("ci", ["true", ""])
def test_ci_turns_dependency_skips_into_failures(pytester, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text(encoding="utf-8"))
    pytester.makepyfile(test_skips=_SKIPS, test_module_skip='import pytest\n'
                        'pytest.importorskip("edgefinfer_no_such_module")\n\ndef test_never():\n    pass\n')
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--continue-on-collection-errors")
    qnn_missing = importlib.util.find_spec("onnxruntime_qnn") is None
    if ci:
        result.assert_outcomes(failed=1, errors=2 + qnn_missing, skipped=2 - qnn_missing, xfailed=1)
        result.stdout.fnmatch_lines(["*CI: dependency edgefinfer_no_such_module missing; the dev extras install it*"])
    else:
        result.assert_outcomes(skipped=5, xfailed=1)
