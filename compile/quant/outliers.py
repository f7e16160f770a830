"""Outlier channels kept float: LLM.int8()'s decomposition with the channels chosen at build time.

Per-token int8 activations round every channel of a token by one step, which its largest channel
sets; a few input channels of a decoder linear carry values 5-9x the rest (Gemma 3's residual stream
and MLP), so they set that step for every token and round all the others coarsely. Dettmers et al.
(LLM.int8(), 2022) find such outliers per batch at run time; here they are found once, on the
calibration text, as the `n` channels with the largest magnitude seen, and then

    y = W q8(x * keep) + W[:, cols] x[cols] (+ the float zero point's offsets over all of x)

where `keep` zeroes `cols` and the second term is float (QuantLinear's forward; in a .pte,
`layouts.FloatChannelsLinear`). Every linear that reads the same tensor (q/k/v, gate/up) sees the same
statistics, so it gets the same channels, and fused projections stay fusable.
"""

from __future__ import annotations

import torch
from torch import Tensor

from edgefinfer.compile.quant.calibrate import observe_inputs
from edgefinfer.compile.quant.modules import QuantLinear
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer


def input_absmax(model: Transformer, calib: Tensor, batch_size: int = 8) -> dict[str, Tensor]:
    """Per decoder linear with int8 activations, the largest |x| of each input channel [K] over the
    calibration blocks `calib` [N, S] run through `model` as it is (the quantized model: the channels
    are those its own inputs carry)."""
    seen: dict[str, Tensor] = {}

    def record(name: str, x: Tensor) -> None:  # x [T, K]
        a = x.abs().amax(0)
        seen[name] = torch.maximum(seen[name], a) if name in seen else a

    observe_inputs(model, calib, dict(decoder_int8_linears(model)), record, batch_size)
    return seen


def keep_outliers_float(model: Transformer, calib: Tensor | None, n: int, batch_size: int = 8) -> int:
    """Give every decoder linear with int8 activations its `n` largest calibration input channels as
    `float_cols` (sorted ascending). Returns how many linears got them."""
    if calib is None or calib.numel() == 0:
        raise UserError(f"-outliers{n} picks its channels on calibration text, but none was given: pass "
                        "calibration blocks (e.g. --calib-blocks 16) or drop -outliers")
    linears = decoder_int8_linears(model)
    for name, module in linears:  # before the calibration pass, which a bad N would waste
        if n >= module.in_features:
            raise UserError(f"-outliers{n} keeps more channels than {name} has inputs ({module.in_features}); "
                            "use fewer")
    absmax = input_absmax(model, calib, batch_size)
    for name, module in linears:
        cols = absmax[name].topk(n).indices.sort().values  # sorted: identical inputs give identical buffers
        module.register_buffer("float_cols", cols)
    return len(absmax)


def decoder_int8_linears(model: Transformer) -> list[tuple[str, QuantLinear]]:
    """The decoder's linears with int8 activations, by full name (not the head, as -split leaves it)."""
    return [(f"model.layers.{i}.{name}", m) for i, layer in enumerate(model.model.layers)
            for name, m in layer.named_modules() if isinstance(m, QuantLinear) and m.act_quant]
