"""What a build writes and a runtime reads: build and quantization recipes, the artefact's typed
description, the bundle's manifest, the target registry, and what a user's MODEL path is.

A room of the foundation: README.md, Layout; tests/test_layering.py, ROOMS."""
