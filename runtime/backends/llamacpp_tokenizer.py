"""A bundle's tokenizer on llama.cpp: text and ids through the GGUF's own vocabulary.

llama.cpp loads the GGUF's vocabulary with the weights, and its CLI and llama-cpp-python split and join
text with it. `edgefinfer run` on a gpu-server bundle does the same instead of parsing the bundle's
tokenizer.json before the first token: for SmolLM2 that file is 3.5 MB of JSON whose parse (~0.08 s
idle, 0.16-0.19 s on a slower day of this host; 49k merges and 49k entries) was most of the start-up
gap to llama.cpp's own CLI (bench/results/sessions.json). Both describe the same vocabulary (our GGUF
writer writes it from that tokenizer.json), and tests/test_llamacpp_tokenizer.py checks that both split
and join text alike, every token of the reference vocabulary included.

The special tokens and the chat template still come from the bundle's tokenizer_config.json (a few
KB). The `tokenizers` object, which only a grammar compiler needs (it reads the vocabulary from it),
is parsed the first time something asks for `backend`.
"""

from __future__ import annotations

from pathlib import Path

from edgefinfer.runtime.backends.llamacpp_binding import LlamaModel
from edgefinfer.tokenization.tokenizer import Tokenizer, read_special_tokens


class LlamaVocabTokenizer(Tokenizer):
    def __init__(self, model: LlamaModel, folder: Path):
        """model: the loaded GGUF; folder: the bundle, with its tokenizer_config.json and tokenizer.json."""
        super().__init__(None, **read_special_tokens(folder))
        self.model = model
        self.folder = folder

    @property
    def backend(self):
        if self._backend is None:
            self._backend = Tokenizer.from_dir(self.folder).backend
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
