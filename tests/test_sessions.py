"""Sessions (`edgefinfer.runtime.session`): a multi-turn greedy conversation gives exactly the tokens of
stateless runs of the same history on every backend and cache layout, while prefilling only what the
cache lacks; edits re-prefill only from the first changed token; a session saved to disk continues
with the same tokens; bad session files and over-long turns are refused in one line, nothing lost.

One tiny float model (the ChatML tokenizer of tests.helpers) exported to every format, as in
test_runtime_conformance; the ExecuTorch programs go through the export cache (`cache=True`), so a
rerun does not lower them again."""

import json

import numpy as np
import pytest

from edgefinfer.model.checkpoint import save_model
from edgefinfer.errors import UserError
from edgefinfer.runtime.engine import Engine
from edgefinfer.runtime.session import (MAGIC, common_prefix, conversation_cuts, encode_messages, reply_spans,
                                        turn_aligned)
from edgefinfer.decoding.structured import Constraint
from tests.helpers import TEST_THREADS, tiny_model, tiny_tokenizer

CTX = 256
WINDOW = dict(window=24, num_sinks=2, lookahead=8)
TURNS = ["Hello there", "How are you today?", "Tell me a story about a cat."]
STATIC = ["torch", "torch-paged", "executorch", "onnxruntime", "llamacpp"]
WINDOWED = ["torch-window", "executorch-window", "onnxruntime-window", "llamacpp-window"]


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    from edgefinfer.compile.executorch_export import export_pte
    from edgefinfer.compile.gguf_export import export_gguf
    from edgefinfer.compile.onnx_export import export_onnx

    root = tmp_path_factory.mktemp("sessions")
    tok = tiny_tokenizer(320)
    tok.eos_token = None  # random weights: replies run to max_tokens
    model = tiny_model(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                       max_position_embeddings=CTX, eos_token_id=None)
    save_model(model, root / "hf")
    export_pte(model, root / "pte" / "model.pte", recipe="fp32", max_seq_len=CTX, progress=False)
    export_pte(model, root / "ptew" / "model.pte", recipe="fp32", kv="window", progress=False, **WINDOW)
    export_onnx(model, root / "onnx", max_seq_len=CTX)
    export_onnx(model, root / "onnxw", kv="window", window=WINDOW["window"], lookahead=WINDOW["lookahead"])
    (root / "gguf").mkdir()
    export_gguf(model, tok, root / "gguf" / "model.gguf", "f32")
    for sub in ("hf", "pte", "ptew", "onnx", "onnxw", "gguf"):
        tok.save(root / sub)
    return root


def load(root, name: str) -> Engine:
    """A fresh engine for a backend / cache layout name of STATIC + WINDOWED."""
    kw = {"torch": ("hf", "torch", None), "torch-paged": ("hf", "torch", "paged:4"),
          "torch-window": ("hf", "torch", f"window:{WINDOW['window']},sinks:{WINDOW['num_sinks']}"),
          "executorch": ("pte/model.pte", None, None), "executorch-window": ("ptew/model.pte", None, None),
          "onnxruntime": ("onnx", None, None), "onnxruntime-window": ("onnxw", None, None),
          "llamacpp": ("gguf/model.gguf", None, None),
          "llamacpp-window": ("gguf/model.gguf", None, f"window:{WINDOW['window']},sinks:{WINDOW['num_sinks']}")}[name]
    return Engine.load(root / kw[0], backend=kw[1], kv=kw[2], max_seq_len=None if "window" in name else CTX)


def stateless(engine: Engine, messages, max_tokens: int, **kw) -> list[int]:
    out = []
    for _ in engine.stream_ids(encode_messages(engine.tokenizer, messages), max_tokens, on_token=out.append, **kw):
        pass
    return out


def turn(session, message: str, max_tokens: int, method: str = "chat", **kw) -> list[int]:
    out = []
    for _ in getattr(session, method)(message, max_tokens, on_token=out.append, **kw):
        pass
    return out


@pytest.mark.parametrize("name", STATIC + WINDOWED)
def test_multi_turn_chat_equals_stateless_runs_and_prefills_only_the_new_tokens(artefacts, name):
    engine, reference = load(artefacts, name), load(artefacts, name)
    session = engine.session()
    aligned = turn_aligned(engine.backend)  # ExecuTorch: the settled assistant turns are kept too
    prompt_lengths = []
    for i, (message, n) in enumerate(zip(TURNS, [1, 10, 10])):  # turn 1 stops at once: its prompt is all cached
        got = turn(session, message, n)
        assert got == stateless(reference, session.messages[:-1], n), f"turn {i + 1} differs from a stateless run"
        ids = encode_messages(engine.tokenizer, session.messages[:-1])
        assert session.last.prompt_tokens == len(ids)
        assert session.last.reused_tokens + session.last.prefilled_tokens == len(ids)
        prompt_lengths.append(len(ids))
        turns_end = [end for _, end in reply_spans(engine.tokenizer, session.messages[:-1])]
        if i == 1:  # turn 1 cached exactly its prompt: every cache keeps it (a ring too: it only grows)
            assert session.last.reused_tokens == (turns_end[0] if aligned else prompt_lengths[0])
        if i == 2 and name in STATIC:  # and at least turn 2's prompt since
            assert session.last.reused_tokens >= (turns_end[1] if aligned else prompt_lengths[1])
    assert session.cached_tokens == (reply_spans(engine.tokenizer, session.messages)[-1][1] if aligned
                                     else prompt_lengths[-1] + 9)
    if "window" in name:  # the conversation went past the ring: it streams on
        assert prompt_lengths[-1] > WINDOW["window"] + WINDOW["lookahead"]


@pytest.mark.parametrize("name", ["onnxruntime", "llamacpp"])
def test_an_exact_session_settles_its_reply_into_a_fresh_prefills_cache_bit_for_bit(artefacts, name):
    engine, reference = load(artefacts, name), load(artefacts, name)
    for exact in (True, False):
        session = engine.session(exact=exact)
        turn(session, TURNS[0], 12)
        assert (session.last.settle_s > 0) == exact and session.prefilled == (len(session.cached) if exact else
                                                                                session.last.prompt_tokens)
        reference.backend.reset()
        reference.backend.forward(session.cached, 0)
        ours, theirs = _cache(engine, len(session.cached)), _cache(reference, len(session.cached))
        assert all(np.array_equal(ours[k], theirs[k]) for k in theirs) == exact


def test_an_executorch_program_on_a_prefill_grid_gives_a_prompt_the_same_rows_however_it_is_split(artefacts):
    """Without a grid a .pte's rows change with where a call starts (the tiny float program: by float
    noise; the int8-activation android default: by up to 2.4 logits); on a grid of G they do not, and an
    exact session settles its reply into the cache a fresh prefill of the same ids makes."""
    grid = 8
    ids = encode_messages(load(artefacts, "torch").tokenizer, [{"role": "user", "content": " ".join(TURNS * 3)}])
    cut = 3 * grid  # on the grid

    def rows(backend, splits):
        backend.reset()
        return np.concatenate([backend.forward(ids[a:b], a).copy() for a, b in splits])

    plain = load(artefacts, "executorch").backend
    splits = [(0, cut), (cut, len(ids))]
    assert not (rows(plain, [(0, len(ids))]) == rows(plain, splits)).all()
    engine = Engine.load(artefacts / "pte/model.pte", max_seq_len=CTX, prefill_grid=grid)
    assert (rows(engine.backend, [(0, len(ids))]) == rows(engine.backend, splits)).all()

    reference = Engine.load(artefacts / "pte/model.pte", max_seq_len=CTX, prefill_grid=grid)
    session = engine.session()
    turn(session, TURNS[0], 13)
    turn(session, TURNS[1], 11)
    assert session.last.settle_s > 0 and session.last.reused_tokens % grid == 0
    reference.backend.forward(session.cached, 0)
    ours, theirs = _cache(engine, len(session.cached)), _cache(reference, len(session.cached))
    assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)


def test_an_executorch_session_without_a_grid_holds_a_turn_aligned_stateless_prefills_cache_bit_for_bit(artefacts):
    """Without a grid an ExecuTorch session feeds the conversation in turn-aligned calls (each turn's new
    prompt, then the written assistant turn, `reply_spans`): its cache after three turns is, bit for bit,
    what a fresh prefill of the same history in the same calls holds (`conversation_cuts`), where one call
    over the same ids computes other rows; and the next turn prefills only its new message."""
    engine, reference = load(artefacts, "executorch"), load(artefacts, "executorch")
    session = engine.session()
    for message, n in zip(TURNS, [7, 11, 9]):
        turn(session, message, n)
        assert session.last.settle_s > 0
    ids = list(session.cached)
    cuts = conversation_cuts(reference, session.messages)
    assert len(cuts) == 6 and cuts[-1] == len(ids)  # three assistant turns, the last one settled to its end

    def fresh(bounds):
        reference.backend.reset()
        for a, b in zip(bounds, bounds[1:]):
            reference.backend.forward(ids[a:b], a)
        return _cache(reference, len(ids))

    ours, aligned, one_call = _cache(engine, len(ids)), fresh([0, *cuts]), fresh([0, len(ids)])
    assert all(np.array_equal(ours[k], aligned[k]) for k in aligned)
    assert not all(np.array_equal(ours[k], one_call[k]) for k in one_call)
    turn(session, TURNS[0], 3)
    assert session.last.reused_tokens == len(ids)  # the new message only
    assert session.last.prefilled_tokens == len(encode_messages(engine.tokenizer, session.messages[:-1])) - len(ids)


def test_a_prefill_grid_is_refused_where_it_has_no_meaning(artefacts):
    with pytest.raises(UserError, match="prefill-grid is for ExecuTorch programs, not llamacpp"):
        Engine.load(artefacts / "gguf/model.gguf", max_seq_len=CTX, prefill_grid=8)
    with pytest.raises(UserError, match="must be between 1 and"):
        Engine.load(artefacts / "pte/model.pte", max_seq_len=CTX, prefill_grid=100_000)


def _cache(engine: Engine, length: int) -> dict:
    return {k: v.copy() for k, v in engine.backend.export_cache(length).items()}


@pytest.mark.parametrize("name", ["onnxruntime", "llamacpp"])
def test_backends_that_declare_invariant_prefill_rows_compute_any_chunking_bit_for_bit(artefacts, name):
    """`prefill_grid = 1`: a prompt cut into chunks of any size > 1 gives the rows of one call."""
    backend = load(artefacts, name).backend
    assert backend.prefill_grid == 1
    ids = encode_messages(load(artefacts, "torch").tokenizer, [{"role": "user", "content": " ".join(TURNS * 3)}])
    whole = backend.forward(ids, 0).copy()
    cut = len(ids) // 3
    backend.reset()
    chunked = [backend.forward(ids[:cut], 0).copy(), backend.forward(ids[cut:cut + 7], cut).copy(),
               backend.forward(ids[cut + 7:], cut + 7).copy()]
    assert (np.concatenate(chunked) == whole).all()
    backend.reset()
    steps = [backend.forward(ids[:cut], 0).copy()] + [backend.forward([t], cut + i).copy()
                                                       for i, t in enumerate(ids[cut:])]
    assert not (np.concatenate(steps) == whole).all()  # one-token steps round differently: why sessions re-prefill


@pytest.mark.parametrize("name", ["torch", "executorch", "onnxruntime", "llamacpp"])
def test_editing_the_last_turn_prefills_only_from_the_edit(artefacts, name):
    engine, reference = load(artefacts, name), load(artefacts, name)
    session = engine.session()
    turn(session, TURNS[0], 6)
    turn(session, "Please write a long poem about the sea and its waves", 6)
    before = encode_messages(engine.tokenizer, session.messages[:-1])
    calls = []
    for method in ("forward", "forward_last"):  # forward_last: a prefill on llama.cpp (backends.base.last_logits)
        if (real := getattr(engine.backend, method, None)) is not None:
            setattr(engine.backend, method,
                    lambda tokens, start, real=real: calls.append((start, len(tokens))) or real(tokens, start))
    got = turn(session, "Please write a long poem about the moon", 6, method="edit")
    after = encode_messages(engine.tokenizer, session.messages[:-1])
    keep = common_prefix(before, after)
    assert keep > len(after) // 2  # the edit is near the end
    if turn_aligned(engine.backend):  # exact on ExecuTorch: from the edited turn's first call on
        keep = max(end for _, end in reply_spans(engine.tokenizer, session.messages[:-1]))
    assert calls[0] == (keep, len(after) - keep)  # the prefill: only the edited suffix, at its position
    assert session.last.prefilled_tokens == len(after) - keep
    assert [m["content"] for m in session.messages if m["role"] == "user"] == [
        TURNS[0], "Please write a long poem about the moon"]
    assert got == stateless(reference, session.messages[:-1], 6)


def test_a_turn_past_the_context_is_refused_and_the_session_keeps_its_cache(artefacts):
    engine = load(artefacts, "onnxruntime")
    session = engine.session()
    turn(session, TURNS[0], 8)
    messages, cached = list(session.messages), list(session.cached)
    with pytest.raises(UserError, match=f"exceeds the context of {CTX} tokens"):
        turn(session, TURNS[1], CTX)
    assert session.messages == messages and session.cached == cached and session.cached_tokens == len(cached)
    turn(session, TURNS[1], 8)  # the session goes on from its cache
    assert session.last.reused_tokens >= len(encode_messages(engine.tokenizer, messages[:1]))


@pytest.mark.parametrize("name", ["torch", "llamacpp"])
def test_speculative_and_structured_output_inside_a_session(artefacts, name):
    plain = load(artefacts, name).session()
    path = artefacts / ("hf" if name == "torch" else "gguf/model.gguf")
    fast = Engine.load(path, backend=name, max_seq_len=CTX, speculative="lookup:2,4").session()
    regex = Constraint.regex("(ab|cd)+ [0-9]{3}")
    for message in TURNS[:2]:
        assert turn(fast, message, 10) == turn(plain, message, 10)
    want = turn(plain, TURNS[2], 16, response_format=regex)  # a constrained turn in the same conversation
    assert turn(fast, TURNS[2], 16, response_format=regex) == want
    assert plain.engine.tokenizer.decode(want)[:2] in ("ab", "cd")
    assert fast.engine.speculation.stats.proposed > 0
    assert fast.last.reused_tokens > 0


@pytest.mark.parametrize("name", STATIC + WINDOWED)
def test_a_saved_session_continues_with_the_live_sessions_tokens(artefacts, tmp_path, name):
    live = load(artefacts, name).session()
    turn(live, TURNS[0], 1)
    turn(live, TURNS[1], 8)
    file = live.save(tmp_path / "chat.efs")
    header = _header(file)
    assert header["backend"] == live.engine.backend.name and header["tokens"] == live.cached
    want_state = "tokens" if name == "torch-paged" else "kv"  # ExecuTorch: the program's named buffers
    assert header["state"] == want_state
    restored = load(artefacts, name).load_session(file)
    assert restored.messages == live.messages
    assert turn(restored, TURNS[2], 8) == turn(live, TURNS[2], 8)
    assert restored.last.reused_tokens == (live.last.reused_tokens if want_state == "kv" else 0)


@pytest.mark.parametrize("name", ["onnxruntime", "llamacpp"])
def test_a_saved_session_remembers_which_rows_a_prefill_computed(artefacts, tmp_path, name):
    """A reply the caller stopped is not settled: its decoded rows stay unkept in the file too, and the
    restored session prefills them again as the live one does."""
    live = load(artefacts, name).session()
    turn(live, TURNS[0], 6)
    produced = []
    stream = live.chat(TURNS[1], 8, on_token=produced.append)
    while len(produced) < 4:
        next(stream)
    stream.close()  # stopped by the caller (Ctrl-C in `edgefinfer chat`)
    prompt = live.last.prompt_tokens
    assert live.last.settle_s == 0 and live.prefilled == prompt < len(live.cached)
    assert _header(live.save(tmp_path / "chat.efs"))["prefilled_tokens"] == prompt
    restored = load(artefacts, name).load_session(tmp_path / "chat.efs")
    assert restored.prefilled == prompt
    assert turn(restored, TURNS[2], 8) == turn(live, TURNS[2], 8)
    assert restored.last.reused_tokens == live.last.reused_tokens <= prompt


def _header(file) -> dict:
    data = file.read_bytes()
    n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
    return json.loads(data[len(MAGIC) + 8:len(MAGIC) + 8 + n])


def test_bad_session_files_are_refused_in_one_line_and_the_session_is_left_as_it_was(artefacts, tmp_path):
    engine = load(artefacts, "onnxruntime")
    session = engine.session()
    turn(session, TURNS[0], 1)
    good = session.save(tmp_path / "good.efs")
    data = good.read_bytes()
    n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
    header = json.loads(data[len(MAGIC) + 8:len(MAGIC) + 8 + n])
    def variant(name, **change):
        head = json.dumps({**header, **change}).encode()
        path = tmp_path / name
        path.write_bytes(MAGIC + len(head).to_bytes(8, "little") + head + data[len(MAGIC) + 8 + n:])
        return path

    torch_file = load(artefacts, "torch").session()
    turn(torch_file, TURNS[0], 1)
    other_model = load(artefacts, "onnxruntime-window").session()  # another ONNX artefact
    turn(other_model, TURNS[0], 1)
    shorter = Engine.load(artefacts / "onnx", max_seq_len=CTX // 2).session()  # the same one, a smaller cache
    turn(shorter, TURNS[0], 1)
    cases = {
        "truncated": ((tmp_path / "cut.efs").write_bytes(data[:-100]) and tmp_path / "cut.efs", "is truncated"),
        "version": (variant("v2.efs", version=2), "version 2 session file; this edgefinfer reads version 1"),
        "backend": (torch_file.save(tmp_path / "torch.efs"), "another backend"),
        "model": (other_model.save(tmp_path / "other.efs"), "another model"),
        "layout": (shorter.save(tmp_path / "short.efs"), "another cache layout"),
        "missing": (tmp_path / "nothing.efs", "no session file at"),
        "not a session": (artefacts / "onnx" / "tokenizer.json", "is not an edgefinfer session file"),
        "damaged": (variant("bad.efs", payload_sha256="0" * 64), "is damaged"),
    }
    messages, cached = list(session.messages), list(session.cached)
    for case, (path, message) in cases.items():
        with pytest.raises(UserError, match=message) as e:
            engine.load_session(path)
        assert "\n" not in str(e.value), case
        assert session.messages == messages and session.cached_tokens == len(cached), case
    turn(session, TURNS[1], 4)
    assert session.last.reused_tokens == len(cached)  # the refusals did not touch its cache



def test_a_smollm2_conversation_reuses_its_replies_and_equals_stateless_runs(smollm2_dir):
    """The shipped SmolLM2 (torch, float32) with its own chat template: real replies re-tokenize to the
    ids the model produced, so each turn keeps the previous reply in the cache too (the Q4_1 GGUF: the
    test after this one)."""
    engine, stateless_engine = (Engine.load(smollm2_dir, max_seq_len=512) for _ in range(2))
    session = engine.session()
    previous = 0
    for message in ["What is the capital of France?", "And of Italy?"]:
        got = turn(session, message, 12)
        assert got == stateless(stateless_engine, session.messages[:-1], 12)
        if previous:
            assert session.last.reused_tokens > previous  # the prompt and (part of) the reply before it
        previous = session.last.prompt_tokens


def test_a_smollm2_gguf_conversation_equals_stateless_runs_because_replies_are_prefilled_again():
    """The shipped Q4_1 GGUF on llama.cpp, whose one-token steps round differently from its prompt
    batches (logits off by up to ~1): an exact session (the default) prefills each reply again as it
    ends, and every reply is a stateless run's; keeping the decoded replies (`exact=False`) parts
    from the stateless runs."""
    from edgefinfer.model import reference

    path = reference.gguf_path("smollm2-135m")
    engine, stateless_engine = (Engine.load(path, max_seq_len=1024, threads=TEST_THREADS) for _ in range(2))
    messages = ["What is the capital of France?", "Tell me about its museums.", "And its food?",
                "Which one would you pick first?"]
    for exact in (True, False):
        session, same, previous = engine.session(exact=exact), [], 0
        for message in messages:
            got = turn(session, message, 40)
            same.append(got == stateless(stateless_engine, session.messages[:-1], 40))
            assert (session.last.settle_s > 0) == exact
            assert session.last.reused_tokens > previous or not previous  # the last prompt and the reply after it
            previous = session.last.prompt_tokens
        assert all(same) if exact else not all(same), f"exact={exact}: turns equal to stateless runs: {same}"


def test_plain_text_sessions_continue_the_transcript(artefacts):
    engine, reference = load(artefacts, "torch"), load(artefacts, "torch")
    session = engine.session()
    for text in ["It is a truth universally acknowledged", ", that a single man", " in possession of"]:
        prompt = session.transcript + text
        got = turn(session, text, 8, method="stream")
        want = reference.generate(prompt, max_tokens=8)
        assert got == want.token_ids and session.transcript.endswith(want.text)
    assert session.last.reused_tokens > 0
