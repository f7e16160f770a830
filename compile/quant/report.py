"""The quality/size report of a quantized model and its one-screen summary table."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from edgefinfer.compile.quant.apply import QuantResult
from edgefinfer.compile.quant.modules import FLOAT_BYTES
from edgefinfer.data.evaluate import compare, perplexity
from edgefinfer.model.transformer import Transformer


@dataclass(frozen=True)
class Quality:
    test_ppl: float
    float_test_ppl: float
    kl_to_float: float  # mean KL(float || quantized) per token, nats
    top1_agreement: float  # fraction of positions where both models' argmax agree
    eval_tokens: int
    window: int
    stride: int

    @property
    def ppl_increase(self) -> float:
        return self.test_ppl / self.float_test_ppl - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ppl_increase": self.ppl_increase}


def float_size_bytes(model: Transformer) -> int:
    """The float model at 2 bytes per parameter (fp16/bf16), tied embeddings counted once."""
    return FLOAT_BYTES * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@torch.inference_mode()
def measure_quality(float_model: Transformer, quant_model: Transformer, ids: Tensor, window: int = 512,
                    stride: int = 256, max_tokens: int | None = 4096, float_ppl: float | None = None,
                    progress: bool = False) -> Quality:
    """Strided test perplexity of both models, and KL / top-1 agreement over the same tokens."""
    q = perplexity(quant_model, ids, window, stride, max_tokens, progress=progress)
    if float_ppl is None:
        float_ppl = perplexity(float_model, ids, window, stride, max_tokens, progress=progress).ppl
    agree = compare(float_model, quant_model, ids, window, max_tokens=max_tokens)
    return Quality(q.ppl, float_ppl, agree.kl, agree.top1, q.tokens, window, stride)


def build_report(result: QuantResult, quality: Quality | None, float_bytes: int, extra: dict[str, Any]) -> dict:
    report: dict[str, Any] = {
        "recipe": result.recipe.name,
        "method": result.recipe.method,
        "size_bytes": result.size_bytes,
        "float_size_bytes": float_bytes,
        "size_ratio_to_fp16": result.size_bytes / float_bytes,
        "quantize_seconds": result.seconds,
        "per_layer_bits": result.bits_table(),
        "recipe_config": result.recipe.to_dict(),
    }
    if quality is not None:
        report.update(quality.to_dict())
    if result.awq_gain:
        report["awq_mean_loss_reduction"] = sum(result.awq_gain) / len(result.awq_gain)
    report.update(extra)
    return report


def summary_table(model: Transformer, result: QuantResult, quality: Quality | None, float_bytes: int) -> str:
    """Modules, parameters and bytes per format, then size and quality in two lines."""
    count: dict[str, int] = defaultdict(int)
    params: dict[str, int] = defaultdict(int)
    for name, label in result.bits_table().items():
        if name == "lm_head" and result.tied_head:
            continue
        count[label] += 1
        params[label] += model.get_submodule(name).weight.numel()
    lines = [f"{'format':18s} {'modules':>8s} {'params':>10s}", "-" * 38]
    lines += [f"{label:18s} {count[label]:8d} {params[label] / 1e6:9.2f}M" for label in sorted(count)]
    lines.append(f"size {result.size_bytes / 1e6:.2f} MB = {100 * result.size_bytes / float_bytes:.1f}% of fp16 "
                 f"({float_bytes / 1e6:.2f} MB); quantized in {result.seconds:.1f}s")
    if quality is not None:
        lines.append(f"test ppl {quality.test_ppl:.3f} (float {quality.float_test_ppl:.3f}, "
                     f"{100 * quality.ppl_increase:+.2f}%), KL {quality.kl_to_float:.4f}, "
                     f"top-1 agreement {100 * quality.top1_agreement:.1f}% over {quality.eval_tokens} tokens")
    return "\n".join(lines)
