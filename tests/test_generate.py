"""Sampling, tokenizer, generation loop, stop strings and streaming on tiny models."""

import torch
import pytest

from edgefinfer.decoding.eager import generate_ids, generate_text, stream_text
from edgefinfer.errors import UserError
from edgefinfer.decoding.generation import StopStringMatcher
from edgefinfer.decoding.sampling import SamplingParams, apply_repetition_penalty, logits_to_probs, next_token
from edgefinfer.tokenization.tokenizer import IncrementalDecoder, Tokenizer
from tests.helpers import tiny_model, tiny_tokenizer


def reference_greedy(model, ids, n):
    """Greedy decoding by full forward passes, no cache: the reference for the cached loop."""
    ids = list(ids)
    out = []
    for _ in range(n):
        with torch.no_grad():
            tok = int(model(torch.tensor([ids]))[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


def test_greedy_loop_equals_uncached_reference():
    model = tiny_model(eos_token_id=None)
    prompt = [5, 17, 42, 8, 9]
    assert list(generate_ids(model, prompt, 20)) == reference_greedy(model, prompt, 20)


def test_generation_stops_at_eos_and_yields_it():
    model = tiny_model(eos_token_id=None)
    prompt = [5, 17, 42]
    free = reference_greedy(model, prompt, 10)
    stop = free[3]
    first = free.index(stop)
    got = list(generate_ids(model, prompt, 10, stop_ids=(stop,)))
    assert got == free[: first + 1]


def test_seeded_sampling_is_reproducible_and_differs_from_greedy():
    model = tiny_model(eos_token_id=None)
    params = SamplingParams(temperature=1.5, top_k=50, seed=123)
    a = list(generate_ids(model, [1, 2, 3], 30, params))
    b = list(generate_ids(model, [1, 2, 3], 30, params))
    assert a == b
    assert a != list(generate_ids(model, [1, 2, 3], 30))


def test_logits_to_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    assert torch.equal(logits_to_probs(logits, 0.0), torch.tensor([[1.0, 0, 0, 0, 0]]))
    p = logits_to_probs(logits, 1.0, top_k=2)
    assert (p[0, 2:] == 0).all() and torch.allclose(p.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)[0]
    # top_p=0.8: tokens 0 and 1 hold 0.574+0.211=0.785 < 0.8, so token 2 is needed too; 3 and 4 go.
    p = logits_to_probs(logits, 1.0, top_p=0.8)[0]
    assert (p[:3] > 0).all() and (p[3:] == 0).all()
    assert torch.allclose(p[:3], full[:3] / full[:3].sum())
    # Temperature sharpens: the argmax gains mass.
    assert logits_to_probs(logits, 0.5)[0, 0] > full[0]


def test_repetition_penalty_matches_ctrl_rule():
    logits = torch.tensor([[2.0, -1.0, 3.0]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1]]), 2.0)
    assert torch.equal(out, torch.tensor([[1.0, -2.0, 3.0]]))
    # A penalty strong enough changes the greedy choice.
    assert next_token(torch.tensor([[3.0, 2.0]]), SamplingParams(repetition_penalty=2.0), torch.tensor([[0]])) == 1


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(repetition_penalty=0)])
def test_bad_sampling_params(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad)


def test_stop_string_matcher_holds_back_partial_matches():
    m = StopStringMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", False)
    assert m.push("O") == ("", False)
    assert m.push("P and more") == ("", True)
    m = StopStringMatcher(["STOP"])
    assert m.push("ST") == ("", False)
    assert m.push("ay") == ("STay", False)


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    tok = tiny_tokenizer()
    text = "It is a truth, 12 naïve café ✓ 你好."
    assert tok.decode(tok.encode(text)) == text
    tok.save(tmp_path)
    again = Tokenizer.from_dir(tmp_path)
    assert again.encode(text) == tok.encode(text)
    assert again.eos_id == tok.backend.token_to_id("<|im_end|>")
    rendered = again.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert again.encode(rendered)[0] == again.bos_id  # special tokens are single ids


def test_incremental_decoder_never_emits_broken_characters():
    tok = tiny_tokenizer()
    text = "naïve café ✓ 你好 déjà vu"
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in tok.encode(text)] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def _metaspace_tokenizer():
    """A SentencePiece-style BPE (Metaspace): decoding drops the space of a text's first word, so
    decoding a window that starts mid-text differs from slicing the full decode."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<|im_end|>"], show_progress=False)
    backend.train_from_iterator(["the cat sat on the mat and the dog sat on the log"] * 20, trainer)
    return Tokenizer(backend, eos_token="<|im_end|>")


@pytest.mark.parametrize("make", [tiny_tokenizer, _metaspace_tokenizer], ids=["byte-level", "metaspace"])
def test_incremental_decoder_equals_full_decode_and_decodes_a_short_window(make):
    tok = make()
    gen = torch.Generator().manual_seed(0)
    texts = ["the cat sat on the mat", "naïve café ✓ 你好 déjà vu" if make is tiny_tokenizer else "the dog sat"]
    random_ids = [torch.randint(0, tok.vocab_size, (60,), generator=gen).tolist() for _ in range(20)]
    for ids in [tok.encode(t) for t in texts] + random_ids:
        dec = IncrementalDecoder(tok)
        pieces = [dec.push(i) for i in ids] + [dec.flush()]
        assert "".join(pieces) == tok.decode(ids)
    # Plain text: every token is emitted as it comes, decoding only the last two tokens each time
    # (the old decoder re-decoded the whole output per token: O(n^2) over a long reply).
    dec = IncrementalDecoder(tok)
    ids = tok.encode("the cat sat on the mat " * 30)
    for n, i in enumerate(ids, 1):
        assert dec.push(i) != "" or tok.decode([i]) == ""
        assert dec.read_offset == n and n - dec.prefix_offset <= 2


def test_incremental_decoder_keeps_streaming_after_a_decoder_rewrites_sent_text():
    """A decoder that rewrites across tokens ("ab" -> "X" after Fuse) changes text already sent; what
    was sent stays sent, and every later token's text still arrives (it once stopped for good)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    backend = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "a", "b", "c", "d"])}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    tok = Tokenizer(backend)
    ids = tok.encode("a b c d c")
    assert tok.decode(ids) == "Xcdc"
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert pieces == ["a", "", "c", "d", "c", ""]


def test_stream_text_with_stop_string_and_streamed_equals_full():
    tok = tiny_tokenizer()
    tok.eos_token = None  # a random model may emit <|im_end|>; here we test the length and stop-string paths
    model = tiny_model(vocab_size=tok.vocab_size, eos_token_id=None)
    full = generate_text(model, tok, "It is a truth", max_new_tokens=40)
    streamed = "".join(stream_text(model, tok, "It is a truth", max_new_tokens=40))
    assert streamed == full.text and full.finish_reason == "length"
    assert full.stats.generated_tokens == 40
    stop = full.text[5:8]
    cut = generate_text(model, tok, "It is a truth", max_new_tokens=40, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_prompt_longer_than_context_is_a_user_error():
    model = tiny_model()
    with pytest.raises(UserError, match="exceeds the model's context of 128 tokens"):
        list(generate_ids(model, [1] * 120, 20))
