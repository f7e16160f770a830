"""The MODEL argument of the commands: a Hugging Face folder or the name of a shipped reference model.

Light at import (no torch): `edgefinfer --help` imports this module; the reference models load lazily.
"""

from __future__ import annotations

from pathlib import Path

from edgefinfer.bundle.resolve import resolve

DEFAULT_MODEL = "smollm2-135m"


def resolve_model(model: str) -> Path:
    """A model argument is a HF folder or the name of a shipped reference model (pulled once)."""
    return resolve(model, backend="torch", names="checkpoint").path
