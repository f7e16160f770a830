"""Files on this machine: written atomically, hashed once per version, the user cache, and model
files checked as untrusted input before a parser that trusts them sees them.

A room of the foundation: README.md, Layout; tests/test_layering.py, ROOMS."""
