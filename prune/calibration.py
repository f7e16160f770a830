"""Calibration: run token blocks through the decoder one layer at a time and record what each Linear sees.

Activation-aware pruning (Wanda, SparseGPT) scores a weight by the inputs that reach it. Those inputs
should come from the model *as pruned so far*, so the driver walks the layers in order: collect the
statistics of layer i with its dense weights, prune layer i, then run the pruned layer to produce the
inputs of layer i + 1 (the sequential scheme of the SparseGPT and Wanda papers). Only one layer's
activations are alive at a time: [N, S, d] plus the layer's own intermediates, in chunks of blocks.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor, nn

from edgefinfer.errors import UserError
from edgefinfer.model.transformer import DecoderLayer, Transformer, first_rows

# The Linear layers of a decoder layer, by their name inside it; pruning touches these and nothing else
# (embeddings, norms and lm_head stay dense, as in the Wanda and SparseGPT papers).
LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass
class InputStats:
    """What one Linear saw during calibration, summed over every calibration token."""

    sq_sum: Tensor  # [in] sum of x_j^2 over tokens (float64: millions of tokens stay exact enough)
    rows: int = 0  # tokens seen
    gram: Tensor | None = None  # [in, in] sum of x x^T (SparseGPT's Hessian up to a factor), float32

    @property
    def norm(self) -> Tensor:
        """||X_j||_2: the l2 norm of input channel j over all calibration tokens (Wanda's activation term)."""
        return self.sq_sum.sqrt().float()

    def hessian(self) -> Tensor:
        """H = X^T X / rows, the (scaled) Hessian of the layer-wise squared reconstruction error."""
        if self.gram is None:
            raise RuntimeError("these statistics were collected without the Gram matrix (gram=False)")
        return self.gram / max(self.rows, 1)


@dataclass
class _Collector:
    gram: bool
    stats: dict[str, InputStats] = field(default_factory=dict)

    def hook(self, name: str):
        def record(_module: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # [tokens, in]
            st = self.stats.get(name)
            if st is None:
                st = self.stats[name] = InputStats(torch.zeros(x.shape[1], dtype=torch.float64, device=x.device))
                if self.gram:
                    st.gram = torch.zeros(x.shape[1], x.shape[1], device=x.device)
            st.sq_sum += x.pow(2).sum(0, dtype=torch.float64)
            st.rows += x.shape[0]
            if st.gram is not None:
                st.gram.addmm_(x.T, x)
        return record


@contextmanager
def record_inputs(layer: nn.Module, gram: bool = False, names: tuple[str, ...] = LINEAR_NAMES
                  ) -> Iterator[dict[str, InputStats]]:
    """Within the block, every forward of `layer` adds its Linear inputs to the yielded statistics."""
    collector = _Collector(gram)
    handles = [layer.get_submodule(n).register_forward_pre_hook(collector.hook(n)) for n in names]
    try:
        yield collector.stats
    finally:
        for h in handles:
            h.remove()


class LayerwiseRunner:
    """Carries the calibration activations from one decoder layer to the next.

    Usage: `for i, layer in runner.layers(): stats = runner.collect(layer); <prune layer>; runner.advance(layer)`.
    """

    def __init__(self, model: Transformer, blocks: Tensor, chunk: int = 8):
        if blocks.dim() != 2 or blocks.numel() == 0:
            raise UserError(f"calibration needs token blocks [N, S] with N, S > 0, got shape {tuple(blocks.shape)}")
        self.model = model
        self.chunk = max(1, chunk)
        device = model.lm_head.weight.device
        blocks = blocks.to(device)
        N, S = blocks.shape
        self.pos = torch.arange(S, device=device)[None].expand(min(N, self.chunk), S)  # [b, S]
        with torch.no_grad():
            self.x = model.embed(blocks)  # [N, S, d]
        self.ropes = model.rope_tables(self.pos, self.x.dtype)

    def layers(self) -> Iterator[tuple[int, DecoderLayer]]:
        return iter(enumerate(self.model.model.layers))  # type: ignore[arg-type]

    @torch.no_grad()
    def forward(self, layer: nn.Module) -> Tensor:
        """The layer's output on the current activations (nothing is stored)."""
        outs = []
        for begin in range(0, self.x.shape[0], self.chunk):
            x = self.x[begin: begin + self.chunk]  # [b, S, d]
            b = x.shape[0]
            outs.append(layer(x, first_rows(self.ropes, b), self.pos[:b], None))
        return torch.cat(outs)

    def collect(self, layer: nn.Module, gram: bool = False) -> dict[str, InputStats]:
        with record_inputs(layer, gram) as stats:
            self.forward(layer)
        return stats

    def advance(self, layer: nn.Module) -> None:
        """Replace the activations by this layer's output: the next layer's inputs."""
        self.x = self.forward(layer)


def collect_all(model: Transformer, blocks: Tensor, gram: bool = False, chunk: int = 8) -> list[dict[str, InputStats]]:
    """Input statistics of every layer of the dense model, in one pass (no pruning in between)."""
    runner = LayerwiseRunner(model, blocks, chunk)
    out = []
    for _, layer in runner.layers():
        with record_inputs(layer, gram) as stats:
            runner.advance(layer)
        out.append(stats)
    return out


def calibration_blocks(tokenizer, num_blocks: int, block_len: int, seed: int = 0) -> Tensor:
    """`num_blocks` random blocks of `block_len` tokens from the `calib` split: LongTensor [N, S]."""
    from edgefinfer.data.corpora import split_blocks

    if num_blocks <= 0 or block_len <= 0:
        raise UserError(f"calibration needs at least one block of at least one token "
                        f"(got {num_blocks} blocks of {block_len})")
    return split_blocks("calib", tokenizer, block_len, num_blocks, seed=seed)
