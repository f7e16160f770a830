"""Text to token ids and back: the tokenizer of a Hugging Face folder (special tokens, chat
template) and a GGUF's SentencePiece vocabulary as a `tokenizers` BPE.

A room of the foundation: README.md, Layout; tests/test_layering.py, ROOMS."""
