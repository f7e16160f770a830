"""Text corpora with fixed, checked splits, and the quality metrics scored on them.

A room of the foundation: README.md, Layout; tests/test_layering.py, ROOMS."""
