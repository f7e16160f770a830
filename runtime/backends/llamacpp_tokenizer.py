"""A GGUF's tokenizer on llama.cpp: text and ids through the GGUF's own vocabulary.

llama.cpp loads the GGUF's vocabulary with the weights, and its CLI, llama-server and llama-cpp-python
split and join text with it. `edgefinfer run`, `chat` and `serve` on llama.cpp do the same instead of
building a second tokenizer before the first token (`ModelSource.llama_vocab` says where):

* a gpu-server bundle: its tokenizer.json (for SmolLM2 3.5 MB of JSON; the parse, ~0.08 s idle, 0.16-0.19 s
  on a slower day of this host, was most of the start-up gap to llama.cpp's own CLI,
  bench/results/sessions.json) is not parsed. Both describe the same vocabulary (our GGUF writer writes
  it from that tokenizer.json), and tests/test_llamacpp_tokenizer.py checks that both split and join text
  alike, every token of the reference vocabulary included. The special tokens and the chat template
  come from the bundle's tokenizer_config.json (a few KB);
* a bare GGUF (no tokenizer.json beside it): the tokens, special tokens and template are the file's,
  as llama.cpp read them, where gguf-py's reading of the file and our rebuilt tokenizer took seconds
  (and exist for two tokenizer kinds only); generation ends on llama.cpp's own end-of-generation ids.

The `tokenizers` object, which only a grammar compiler needs (it reads the vocabulary from it), is
built the first time something asks for `backend`.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgefinfer.bundle.resolve import ModelSource
from edgefinfer.runtime.backends.llamacpp_binding import LlamaModel
from edgefinfer.tokenization.tokenizer import StreamDecoder, Tokenizer, read_special_tokens


class LlamaVocabTokenizer(Tokenizer):
    def __init__(self, model: LlamaModel, specials: dict[str, Any], full: Callable[[], Tokenizer]):
        """specials: `Tokenizer`'s keyword arguments; full: the same vocabulary as a `tokenizers`-backed
        Tokenizer, built only if `backend` is asked for."""
        super().__init__(None, **specials)
        self.model = model
        self._full = full

    @classmethod
    def for_source(cls, src: ModelSource, model: LlamaModel) -> "LlamaVocabTokenizer":
        """`src`'s tokenizer where `src.llama_vocab`: a bundle's (`for_bundle`) or a GGUF alone's (`for_gguf`)."""
        return cls.for_bundle(model, src.folder) if src.kind == "bundle" else cls.for_gguf(model, src.tokenizer)

    @classmethod
    def for_bundle(cls, model: LlamaModel, folder: Path) -> "LlamaVocabTokenizer":
        """A bundle's GGUF, with the bundle's special tokens and template (`folder`'s tokenizer files)."""
        return cls(model, read_special_tokens(folder), lambda: Tokenizer.from_dir(folder))

    @classmethod
    def for_gguf(cls, model: LlamaModel, full: Callable[[], Tokenizer]) -> "LlamaVocabTokenizer":
        """A bare GGUF, with the special tokens and template it carries; full: the file's `tokenizers`
        form (`ModelSource.tokenizer`: gguf-py's reading, seconds; only a grammar asks for it)."""
        bos, eos = model.special_token("bos"), model.special_token("eos")
        specials = {"bos_token": None if bos is None else model.token_text(bos),
                    "eos_token": None if eos is None else model.token_text(eos),
                    "chat_template": model.meta("tokenizer.chat_template"),
                    "add_bos_token": model.adds_bos() and bos is not None}
        return cls(model, specials, full)

    @property
    def backend(self):
        if self._backend is None:
            self._backend = self._full().backend
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.model.token_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.model.tokenize(text, add_special=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.model.detokenize(ids, render_special=not skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return PieceDecoder(self.model, render_special=not skip_special_tokens)


class PieceDecoder:
    """Text deltas as llama-server streams them: each token's bytes (`LlamaModel.piece`, remembered per
    token) through an incremental UTF-8 decoder, which holds back a character split over tokens. A
    dictionary lookup a token where the windowed `IncrementalDecoder` made two llama_detokenize calls
    (at one request 0.09 ms of a 13 ms step went to text, bench/server_step.py). The first token goes
    through detokenize, whose start-of-text rule (a SentencePiece vocabulary's leading space dropped,
    as `tokenizers` drops it too) is the one a join of pieces lacks.

    The deltas join into `LlamaModel.detokenize` of all the ids but where llama.cpp cleans spaces
    (`clean_spaces`, on for some byte-level vocabularies: Llama 3's, GPT-2's): its whole-text decode
    drops the space before ? ! . , which a stream has sent before the punctuation came. The windowed
    decode then stopped emitting for good (a window no longer started with its prefix); here the
    text keeps its spaces, as llama-server's and vLLM's streams and `tokenizers`' decode keep them."""

    def __init__(self, model: LlamaModel, render_special: bool):
        self._model, self._render_special = model, render_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._started = False

    def push(self, token_id: int) -> str:
        if self._started:
            return self._utf8.decode(self._model.piece(token_id, self._render_special))
        self._started = True
        return self._utf8.decode(self._model.detokenize_bytes([token_id], self._render_special))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
