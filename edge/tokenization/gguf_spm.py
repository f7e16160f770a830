"""A GGUF's SentencePiece tokenizer (`tokenizer.ggml.model == "llama"`, e.g. Gemma 3) as a `tokenizers` BPE.

llama.cpp's `llm_tokenizer_spm` splits a text fragment into UTF-8 characters and then, again and again,
merges the adjacent pair whose concatenation is a vocabulary token with the highest score (the leftmost
pair on ties); a character that ends up in no token becomes its <0xNN> byte tokens. A `tokenizers` BPE
model does the same when

* its merges are every split (a, b) of every vocabulary token t = a + b with both a and b in the
  vocabulary, ranked by the score of t, highest first (so the pair it picks is llama.cpp's pair);
* byte_fallback is on (a character outside the vocabulary -> <0xNN> tokens);
* the normalizer turns " " into "▁" (and prefixes "▁" only when tokenizer.ggml.add_space_prefix, which
  defaults to true for SPM files, as in llama.cpp; Gemma's is false);
* control, unknown and user-defined tokens are added tokens matched whole in the raw text before the
  rest is tokenized, as llama.cpp's special-token partition does (control ones when specials are
  parsed, which is how edgefinfer always encodes).

Two llama.cpp behaviours a BPE model cannot express, neither met by SentencePiece vocabularies as
trained (tests/test_gemma3_tokenizer.py checks Gemma 3's on llama.cpp): a character outside the vocabulary
that still occurs inside some token would merge in llama.cpp (here it falls back to bytes first), and
two *different* merges of equal score are taken leftmost first by llama.cpp, by rank here. Equal scores
are ranked longer token first, then longer left part, which reproduces llama.cpp on runs of a repeated
character; where distinct multi-character tokens share a score (trained SentencePiece vocabularies give
every normal piece its own: Gemma 3's 255474 do), the ids may differ and a warning says so.
"""

from __future__ import annotations

import logging
from collections import Counter

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from edgefinfer.errors import UserError
from edgefinfer.tokenization.tokenizer import Tokenizer, bos_eos_processor

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
# llama.cpp's defaults for an SPM vocabulary whose file does not say (llama-vocab.cpp, load).
_DEFAULT_BOS, _DEFAULT_EOS, _DEFAULT_UNK = 1, 2, 0

log = logging.getLogger(__name__)


def spm_merges(tokens: list[str], scores: list[float], types: list[int] | None = None) -> list[tuple[str, str]]:
    """BPE merges that reproduce llama.cpp's score-ordered SPM merging over this vocabulary (`types`:
    llama.cpp's token types, to warn about normal tokens sharing a score)."""
    ids = {t: i for i, t in enumerate(tokens)}  # llama.cpp maps a duplicated text to its last id
    ranked = []
    for text, i in ids.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in ids and right in ids:
                ranked.append((-float(scores[i]), -len(text), -cut, i, left, right))
    ranked.sort(key=lambda r: r[:4])
    normal = dict.fromkeys((r[0], r[3]) for r in ranked if types is None or types[r[3]] == _NORMAL)
    tied = sum(n for n in Counter(score for score, _ in normal).values() if n > 1)
    if tied:
        log.warning("%d merged tokens of this SentencePiece vocabulary share their score with another; llama.cpp "
                    "merges those leftmost first, which a BPE's ranks cannot express, so a few ids may differ "
                    "from llama.cpp's", tied)
    return [(left, right) for *_, left, right in ranked]


def spm_tokenizer_from_gguf(g) -> Tokenizer:
    """The file's SentencePiece (llama.cpp "llama") tokenizer, giving llama.cpp's ids. `g` is a GGUFFile."""
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(g.require("tokenizer.ggml.tokens"))]  # as llama.cpp
    n = len(tokens)
    scores = g.value("tokenizer.ggml.scores")
    scores = [0.0] * n if scores is None else list(scores)
    types = g.value("tokenizer.ggml.token_type")
    types = [_NORMAL] * n if types is None else list(types)
    if len(scores) != n or len(types) != n:
        raise UserError(f"{g.path}: {n} tokens but {len(scores)} scores and {len(types)} token types; "
                        f"the tokenizer is corrupt")

    def token(key: str, default: int | None) -> str | None:
        i = g.value(f"tokenizer.ggml.{key}", default)
        return tokens[i] if i is not None and 0 <= i < n else None

    vocab = {t: i for i, t in enumerate(tokens)}
    unk = token("unknown_token_id", _DEFAULT_UNK)
    bpe = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk, byte_fallback=True)
    backend = HFTokenizer(bpe)
    escape = normalizers.Replace(" ", "▁")
    add_space_prefix = bool(g.value("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), escape]) if add_space_prefix else escape
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    # Matched whole in the raw text before the normalizer, as llama.cpp partitions them out first.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types, strict=True) if k in (_CONTROL, _UNKNOWN)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED])

    bos, eos = token("bos_token_id", _DEFAULT_BOS), token("eos_token_id", _DEFAULT_EOS)
    add_bos = bool(g.value("tokenizer.ggml.add_bos_token", True)) and bos is not None
    add_eos = bool(g.value("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:

        backend.post_processor = bos_eos_processor(bos if add_bos else None, eos if add_eos else None, backend)
    return Tokenizer(backend, bos_token=bos, eos_token=eos, chat_template=g.value("tokenizer.chat_template"),
                     add_bos_token=add_bos)
