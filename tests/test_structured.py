"""Structured output (edgefinfer.decoding.structured): constraints compile or fail with one line, masks follow
the grammar, drafts are cut where the grammar breaks, and constrained decoding on the reference
model gives output that parses and validates, the same tokens with and without speculation."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from edgefinfer.errors import UserError
from edgefinfer.runtime.speculative.proposers import Draft
from edgefinfer.decoding.structured import Constraint, GrammarCompiler, trim_draft
from edgefinfer.tokenization.tokenizer import Tokenizer
from tests.helpers import TEST_THREADS, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from structured_tasks import is_valid, tasks  # noqa: E402

MODEL = "smollm2-135m"
STOPS = (2, 0)  # <|im_end|>, <|endoftext|>


@pytest.fixture(scope="module")
def compiler(smollm2_dir) -> GrammarCompiler:
    return GrammarCompiler(Tokenizer.from_dir(smollm2_dir), 49152, STOPS)


# ---- compile errors --------------------------------------------------------------------------------
@pytest.mark.reference
@pytest.mark.parametrize("make, message", [
    (lambda: Constraint.json_schema('{"type": "object"'), "the JSON schema is not valid JSON"),
    (lambda: Constraint.json_schema({"type": "wrongtype"}), "the JSON schema does not compile: Invalid type"),
    (lambda: Constraint.json_schema([1, 2]), "a JSON schema is an object"),
    (lambda: Constraint.regex("(unclosed"), "the regex does not compile"),
    (lambda: Constraint.regex(""), "the regex is empty"),
    (lambda: Constraint.grammar("start: missing_rule\n"), "the grammar does not compile: unknown name"),
    (lambda: Constraint.grammar('root ::= "unterminated\n'), "the grammar does not compile"),
    (lambda: Constraint.from_response_format({"type": "xml"}), "unknown response_format type 'xml'"),
    (lambda: Constraint.from_response_format({"type": "json_schema"}), "response_format json_schema needs"),
])
def test_bad_constraints_fail_with_one_line(compiler, make, message):
    with pytest.raises(UserError) as e:
        compiler.compile(make())
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.reference
def test_response_format_text_means_no_constraint_and_gbnf_and_lark_both_compile(compiler):
    assert Constraint.from_response_format({"type": "text"}) is None
    assert Constraint.from_response_format(None) is None
    for grammar in ('root ::= "yes" | "no"\n', 'start: "yes" | "no"\n'):
        assert compiler.compile(Constraint.grammar(grammar)).constraint.kind == "grammar"


# ---- masks --------------------------------------------------------------------------------------------
@pytest.mark.reference
def test_mask_allows_exactly_the_continuations_then_only_end_of_sequence(compiler):
    tok = compiler.tokenizer
    matcher = compiler.compile(Constraint.regex("(yes|no)")).matcher()
    allowed = np.flatnonzero(matcher.allowed())
    texts = {tok.decode([int(i)]) for i in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert tok.encode("yes")[0] in allowed and tok.encode("maybe")[0] not in allowed
    logits = np.zeros(49152, dtype=np.float32)
    masked = matcher.mask(logits)
    assert masked.dtype == np.float32 and np.isneginf(masked).sum() == 49152 - len(allowed)
    for t in tok.encode("yes"):
        matcher.accept(t)
    assert matcher.finished
    assert np.flatnonzero(matcher.allowed()).tolist() == sorted(STOPS)


@pytest.mark.reference
def test_drafts_are_cut_where_the_grammar_breaks_and_rows_masked_per_position(compiler):
    tok = compiler.tokenizer
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    good = tok.encode('{"n": 7}')
    matcher = compiler.compile(Constraint.json_schema(schema)).matcher()
    assert matcher.valid_prefix(good) == len(good)
    bad = good[:-2] + tok.encode("x") + good[-1:]  # a letter where the digit belongs
    draft = trim_draft(matcher, Draft(bad))
    assert draft.tokens == good[:-2]
    assert trim_draft(matcher, Draft(tok.encode("nonsense"))) is None
    rows = np.random.default_rng(0).standard_normal((len(good) + 1, 49152)).astype(np.float32)
    masked = matcher.mask_rows(rows, good)
    assert matcher.valid_prefix(good) == len(good)  # mask_rows left the matcher where it was
    stepwise = compiler.compile(Constraint.json_schema(schema)).matcher()
    for i, row in enumerate(rows):
        np.testing.assert_array_equal(masked[i], stepwise.mask(row))
        if i < len(good):
            stepwise.accept(good[i])
    assert stepwise.finished


def test_a_model_without_end_of_sequence_gets_a_phantom_one():
    tok = tiny_tokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size, ())
    matcher = compiler.compile(Constraint.regex("ab")).matcher()
    assert matcher.allowed().shape == (tok.vocab_size,)
    for t in tok.encode("ab"):
        assert matcher.allowed()[t]
        matcher.accept(t)
    assert matcher.finished and not matcher.allowed().any()


# ---- the engine on the reference model (llama.cpp) ----------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("llama_cpp")
    from edgefinfer.model import reference
    from edgefinfer.runtime.engine import Engine

    return Engine.load(reference.gguf_path(MODEL), threads=TEST_THREADS)


def _schema_format(task: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": task["name"], "schema": task["schema"]}}


@pytest.mark.reference
@pytest.mark.llamacpp
def test_json_schema_output_validates_where_unconstrained_does_not(engine):
    chosen = [tasks()[i] for i in (0, 13, 24)]  # flat; nested object; arrays of objects + enums
    for task in chosen:
        out = engine.generate(task["prompt"], max_tokens=200, chat=True, response_format=_schema_format(task))
        assert out.finish_reason == "stop", out.text
        assert is_valid(out.text, task["schema"]), out.text
    plain = engine.generate(chosen[0]["prompt"], max_tokens=200, chat=True)
    assert not is_valid(plain.text, chosen[0]["schema"])  # what the constraint fixes


@pytest.mark.reference
@pytest.mark.llamacpp
def test_regex_lark_and_json_object_constraints(engine):
    out = engine.generate("My phone number is", max_tokens=20, response_format=Constraint.regex(r"\+1-[0-9]{3}-[0-9]{4}"))
    assert re.fullmatch(r"\+1-[0-9]{3}-[0-9]{4}", out.text) and out.finish_reason == "stop"
    out = engine.generate("Is Paris in France?", max_tokens=5, chat=True,
                          response_format=Constraint.grammar('start: answer "."\nanswer: "Yes" | "No"\n'))
    assert out.text in ("Yes.", "No.") and out.finish_reason == "stop"
    out = engine.generate("A JSON object about a cat:", max_tokens=120, response_format={"type": "json_object"})
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # cut by max_tokens: still a valid prefix of one
        assert out.text.startswith("{")


@pytest.mark.reference
@pytest.mark.llamacpp
def test_a_grammar_that_cannot_finish_ends_with_length(engine):
    out = engine.generate("Letters:", max_tokens=6, response_format=Constraint.regex("[a-z]{500}"))
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert re.fullmatch("[a-z]+", out.text)


@pytest.mark.reference
@pytest.mark.llamacpp
@pytest.mark.parametrize("speculative", ["draft"])  # prompt lookup: exact on f32 models, test_runtime_conformance.py
def test_constrained_speculation_on_the_reference_model_stays_within_the_schema(speculative):
    # Token equality with plain decoding is asserted where the numerics allow it (f32 models, every
    # backend: test_runtime_conformance.py). Here llama.cpp's quantized kernels score a k+1-token batch
    # a little differently from one token at a time, and under a mask the pick is among near-ties, so
    # the tokens may differ; the output must still follow the schema and drafts must be used.
    from edgefinfer.model import reference
    from edgefinfer.runtime.engine import Engine

    gguf = reference.gguf_path(MODEL)
    spec = Engine.load(gguf, threads=TEST_THREADS, speculative=f"draft:{gguf},3" if speculative == "draft" else speculative)
    task = tasks()[17]
    prompt = task["prompt"] + " " + json.dumps({"title": "Dune", "tags": ["sand", "sand"]})  # something to look up
    out = spec.generate(prompt, max_tokens=200, chat=True, response_format=_schema_format(task))
    assert out.finish_reason == "stop" and is_valid(out.text, task["schema"]), out.text
    assert spec.speculation.stats.proposed > 0 and spec.speculation.stats.accepted > 0


@pytest.mark.parametrize("choice, two_calls_allowed", [("required", True), ("get_time", False)])
def test_a_named_tool_choice_is_exactly_one_call(choice, two_calls_allowed):
    """OpenAI's forced function: a named tool_choice calls that function once; "required" may call several."""
    from edgefinfer.decoding.tool_calls import CLOSE, OPEN, parse_tools, tool_call_constraint

    tok = tiny_tokenizer()
    tools = parse_tools([{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                                                                                            "properties": {}}}}])
    call = '{"name": "get_time", "arguments": {}}'
    one, two = (f"{OPEN}[\n" + ",\n".join([call] * n) + f"\n]{CLOSE}" for n in (1, 2))
    grammar = GrammarCompiler(tok, tok.vocab_size, ()).compile(tool_call_constraint(tools, choice))
    for text, allowed in ((one, True), (two, two_calls_allowed)):
        ids = tok.encode(text, add_special_tokens=False)
        matcher = grammar.matcher()
        assert (matcher.valid_prefix(ids) == len(ids)) == allowed, text
