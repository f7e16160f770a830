"""The MODEL argument of the commands: a Hugging Face folder or the name of a shipped reference model.

Light at import (no torch): `edgefinfer --help` imports this module; the reference models load lazily.
"""

from __future__ import annotations

from pathlib import Path

from edgefinfer.errors import UserError

DEFAULT_MODEL = "smollm2-135m"


def resolve_model(model: str) -> Path:
    """A model argument is a HF folder or the name of a shipped reference model (pulled once)."""
    path = Path(model)
    if path.exists():
        return path
    if "/" in model or path.suffix:
        raise UserError(f"model folder {model} does not exist (or pass a known model name, e.g. {DEFAULT_MODEL})")
    from edgefinfer import reference

    if model in reference.MODELS:
        return reference.pull(model)
    raise UserError(f"{model!r} is neither a model folder nor a known model ({', '.join(reference.MODELS)})")
