"""Layer-by-layer calibration: run calibration blocks through the decoder one layer at a time.

GPTQ and AWQ quantize layer i from the activations that enter it, then push those activations
through the *quantized* layer i to get layer i+1's inputs, so every layer is calibrated on the
inputs it will see at inference. Only one layer's activations live in memory at a time.

`capture_inputs` records what enters chosen linears with forward pre-hooks, and stops the layer's
forward pass as soon as the last of them has been reached (computing the rest would be wasted).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer, first_rows

# The linears of a decoder layer grouped by the tensor they read, in execution order.
INPUT_GROUPS: tuple[tuple[str, ...], ...] = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


class _Stop(Exception):
    """Raised by a hook to end a forward pass whose remaining output is not needed."""


class LayerRunner:
    """Calibration hidden states [N, S, D] and the rotary tables to run them through decoder layers."""

    def __init__(self, model: Transformer, blocks: Tensor, batch_size: int = 8):
        if blocks.dim() != 2 or blocks.numel() == 0:
            raise UserError("the calibration set is empty: give at least one block of calibration tokens")
        self.model = model
        self.batch_size = batch_size
        n, s = blocks.shape
        self.positions = torch.arange(s)[None].expand(min(batch_size, n), s)  # [b, S]
        with torch.no_grad():
            self.hidden = model.embed(blocks).float()  # [N, S, D]
        self.ropes = model.rope_tables(self.positions, self.hidden.dtype)

    @property
    def tokens(self) -> int:
        return self.hidden.shape[0] * self.hidden.shape[1]

    def _chunks(self) -> Iterator[Tensor]:
        yield from self.hidden.split(self.batch_size)

    def _call(self, layer: nn.Module, x: Tensor) -> Tensor:
        b = x.shape[0]
        return layer(x, first_rows(self.ropes, b), self.positions[:b], None)

    @torch.no_grad()
    def run(self, layer: nn.Module, until_stop: bool = False) -> Tensor | None:
        """Push every chunk through `layer`. until_stop: hooks end each pass early; nothing is kept."""
        outputs = []
        for x in self._chunks():
            try:
                out = self._call(layer, x)
            except _Stop:
                continue
            if not until_stop:
                outputs.append(out)
        return None if until_stop else torch.cat(outputs)

    @torch.no_grad()
    def advance(self, layer: nn.Module) -> None:
        """Replace the hidden states by `layer`'s outputs (call after quantizing the layer)."""
        self.hidden = self.run(layer)  # type: ignore[assignment]


@contextmanager
def capture_inputs(layer: nn.Module, names: list[str], on_input: Callable[[str, Tensor], None],
                   stop_after: str | None = None) -> Iterator[None]:
    """Call `on_input(name, x [T, K])` with the input of each named submodule of `layer`; raise _Stop
    (caught by LayerRunner.run) right after `stop_after`'s input has been seen."""
    handles = []

    def make_hook(name: str):
        def hook(_module: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0]
            on_input(name, x.reshape(-1, x.shape[-1]).float())
            if name == stop_after:
                raise _Stop

        return hook

    try:
        for name in names:
            handles.append(layer.get_submodule(name).register_forward_pre_hook(make_hook(name)))
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def observe_inputs(model: Transformer, calib: Tensor, modules: dict[Any, nn.Module],
                   on_input: Callable[[Any, Tensor], None], batch_size: int = 8) -> None:
    """Run the calibration blocks `calib` [N, S] through the whole `model` (as it is), calling
    `on_input(key, x [T, K])` with what enters each of `modules` (key -> submodule)."""
    def make_hook(key: Any):
        def hook(_module: nn.Module, args: tuple[Tensor, ...]) -> None:
            on_input(key, args[0].detach().reshape(-1, args[0].shape[-1]).float())
        return hook

    handles = [m.register_forward_pre_hook(make_hook(key)) for key, m in modules.items()]
    try:
        for start in range(0, calib.shape[0], batch_size):
            model(calib[start:start + batch_size])
    finally:
        for h in handles:
            h.remove()


class HessianAccumulator:
    """H = 2/T * sum over tokens of x x^T, the Hessian of GPTQ's layer-wise squared error.

    With `halves=True` the first and second half of every captured batch of rows (whole calibration
    blocks when a batch holds several, else the two halves of the one block) are also kept apart, so
    a choice (GPTQ's damp) can be fitted on one half and judged on the other."""

    def __init__(self, halves: bool = False) -> None:
        self.halves = halves
        self.sums: dict[tuple[str, int], Tensor] = {}
        self.counts: dict[tuple[str, int], int] = {}

    def __call__(self, name: str, x: Tensor) -> None:  # x [T, K]
        x = x.double()
        parts = (x[: x.shape[0] // 2], x[x.shape[0] // 2:]) if self.halves else (x,)
        for half, rows in enumerate(parts):
            key = (name, half)
            if key not in self.sums:
                self.sums[key] = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
                self.counts[key] = 0
            self.sums[key].addmm_(rows.T, rows)
            self.counts[key] += rows.shape[0]

    def hessian(self, name: str, half: int | None = None) -> Tensor:
        """All tokens' Hessian, or (halves=True) that of the first (0) or second (1) half."""
        keys = [(name, half)] if half is not None else [k for k in self.sums if k[0] == name]
        return (2.0 / sum(self.counts[k] for k in keys)) * sum(self.sums[k] for k in keys)


class ActivationSampler:
    """Per input: mean |x| per channel over all tokens, and a uniform sample of about `max_tokens` rows
    (a fixed fraction of every chunk, so memory stays bounded whatever the calibration size)."""

    def __init__(self, max_tokens: int, total_tokens: int, seed: int = 0):
        self.keep = min(1.0, max_tokens / max(total_tokens, 1))
        self.abs_sum: dict[str, Tensor] = {}
        self.counts: dict[str, int] = {}
        self.samples: dict[str, list[Tensor]] = {}
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, name: str, x: Tensor) -> None:  # x [T, K]
        if name not in self.abs_sum:
            self.abs_sum[name] = torch.zeros(x.shape[1], dtype=torch.float64)
            self.counts[name], self.samples[name] = 0, []
        self.abs_sum[name] += x.abs().sum(0, dtype=torch.float64)
        self.counts[name] += x.shape[0]
        n = max(1, round(self.keep * x.shape[0]))
        self.samples[name].append(x[torch.randperm(x.shape[0], generator=self.generator)[:n]].clone())

    def mean_abs(self, name: str) -> Tensor:
        return (self.abs_sum[name] / self.counts[name]).float()

    def rows(self, name: str) -> Tensor:
        return torch.cat(self.samples[name])
