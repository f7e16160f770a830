"""The model: one decoder configured by typed features, the KV-cache contract its attention goes
through, Hugging Face checkpoints and GGUF files in and out, and the shipped reference models.

A room of the foundation: README.md, Layout; tests/test_layering.py, ROOMS."""
