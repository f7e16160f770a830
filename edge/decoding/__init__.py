"""From logits to text: sampling, the generation's contract (stop ids, finish reason, incremental
detokenization), the eager torch loop, structured-output constraints and tool calls.

A room of the foundation: README.md, Layout; tests/test_layering.py, ROOMS."""
