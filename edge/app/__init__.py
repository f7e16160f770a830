"""edgefinfer.app: the application layer, the only code that orchestrates the libraries below it.

The command line (`cli`, one module per stage command), `build` (quantize -> compile -> evaluate ->
bundle) and the peer-runner checks. Dependencies run one way (tests/test_layering.py keeps it so):
foundation (edgefinfer.*) -> distill / prune / compile -> runtime -> server_gpu -> app.
"""
