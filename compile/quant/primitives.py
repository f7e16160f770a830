"""Quantization arithmetic: choosing scales and zero points, rounding, dequantizing.

Conventions (shared by every method and every exporter, see docs/QUANTIZATION.md):

* Integer codes are stored signed in int8: a b-bit code lies in [-2^(b-1), 2^(b-1) - 1]
  (int4: [-8, 7]), as in torchao's `IntxUnpackedToInt8Tensor`. Unsigned layouts (ONNX MatMulNBits,
  GGUF) add 2^(b-1) to codes and zero points, which changes nothing else.
* Dequantization is `(q - zero) * scale` per group of consecutive input channels.
* Scales are rounded *up* to float16 (or, for XNNPACK's 4-bit kernels, which keep scales in
  bfloat16, to bfloat16 values, stored as float16) before the codes are chosen. fp16 (GGUF) and fp32 (ONNX,
  torchao) consumers then dequantize to exactly the same float32 values (`(q - z)` has at most 9
  significant bits and an fp16 scale 11, so their product is exact in float32), and rounding up
  rather than to nearest keeps every value inside the representable range, so no code is clipped.
* Symmetric int8 uses [-127, 127] with scale amax/127 (XNNPACK's and GGUF Q8_0's convention).
  Symmetric codes below 8 bits use the whole [-2^(b-1), 2^(b-1)-1] range with the smallest scale that
  clips nothing: max(max_pos / qmax, min_neg / qmin), so int4 reaches -8 like GGUF Q4_0.
  5-bit symmetric groups exist for GGUF's Q5_0 alone (no XNNPACK or MatMulNBits kernel takes 5 bits)
  and take its convention: the long end of the range, code -16, may sit on either sign, so a group
  whose largest magnitude is positive gets a negative scale (`SIGNED_SCALE_BITS`). The smaller of the
  two covering scales is kept, and a matrix read from a Q5_0 file gets back its codes and scales.
* Asymmetric: scale = (max_pos - min_neg) / (qmax - qmin), an integer zero point in [qmin, qmax]; the
  range always contains 0, so zero is exact (padding and ReLU-like zeros stay zero). Up to 4 bits the
  scale is then bumped up (a few fp16 steps at most, `exact_offset_scale`) until d * (zero + 2^(b-1)) is
  an fp16 value too, so that GGUF's Q4_1 (x = d * q + m, fp16 d and m = -d * zero) holds exactly these
  weights: an fp16 d times a 4-bit integer needs up to 15 significant bits, fp16 has 11.

* Float zero point (`WeightFormat.float_zero`, recipes `-fzp`): the grid has a float bottom m and step d
  per group; the zero point in code units, z = qmin - m / d, is a float32 and dequantization is the same
  `(q - z) * scale`. Up to 4 bits the grid is searched (`least_squares_grid`): among grids of about as
  many steps as levels across the group's range, the one with the least squared error that still covers
  the group, as llama.cpp's k-quants choose their scales and minima; 8 bits take the range's grid. m is
  rounded *down* to fp16, d to the nearest fp16 (bf16). GGUF's Q4_1 stores m = -d * (z - qmin) rounded
  back to fp16, which recovers the chosen bottom exactly (the float32 round trip is off by far less
  than half an fp16 step), so llama.cpp decodes d * nibble + m within float32 rounding of these
  weights. Unlike an integer zero point, zero is not exact; in exchange a weight that already sits on
  such a grid is kept: a checkpoint from Q4_1, and from Q4_K blocks, whose codes seldom reach both ends
  (Gemma 3 270M: +4.0% -> +0.6% perplexity on the bible text, bench/results/gemma3.json `fzp_search`).

* K-quant super-blocks (`WeightFormat.super_block`, GGUF's Q4_K, Q5_K and Q6_K, `superblock_qparams`):
  each group's scale is first chosen as above (Q4_K / Q5_K: the least-squares grid with its bottom at or
  below zero, as llama.cpp's make_qkx2_quants clamps it; Q6_K: signed, the group's largest magnitude on
  code -32, or the finest step holding the group exactly), then the scales of a super-block become
  integer levels of one fp16 step d: 6-bit 1..63 with the largest group on 63 (Q4_K / Q5_K; their minima
  likewise 0..63 of an fp16 dmin, each group's at the lattice shift with the least squared error,
  `_nearest_lattice_minimum`), signed 8-bit with the largest on -128 (Q6_K), as llama.cpp's
  quantize_row_q4_K / q6_K choose them, and the codes are chosen under these scales. d * level has up to 17 significant bits, so these scales are stored as float32
  (`scale_storage_dtype`); the writer recovers d as the largest scale / 63 (/ -128) exactly.

Every rounding error is therefore at most scale / 2 (plus the fp16 rounding of the scale itself).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from edgefinfer.compile.quant.recipe import WeightFormat

FP16_MAX = 65504.0
BF16_MAX_IN_FP16 = 65280.0  # the largest bfloat16 value that float16 holds
SCALE_MIN = 2.0**-14  # smallest normal fp16: all-zero and near-zero groups get this scale
FP8_MAX = 448.0  # largest finite float8 e4m3fn
FP8_SCALE_MIN = 1e-12
SIGNED_SCALE_BITS = (5,)  # symmetric widths whose scale may be negative (GGUF Q5_0's d = max / -16)


class IntWeights(NamedTuple):
    """A weight matrix [N, K] as integer codes in groups of `group_size` input channels."""

    codes: Tensor  # int8 [N, K], values in qrange(bits, symmetric)
    scales: Tensor  # float16 [N, K // group_size]; float32 for K-quant super-blocks
    zeros: Tensor  # int8 [N, K // group_size]; all 0 when symmetric; float32 for a float zero point


class Fp8Weights(NamedTuple):
    codes: Tensor  # float8_e4m3fn [N, K]
    scales: Tensor  # float32 [N, 1]


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """Smallest and largest code of a b-bit format."""
    if symmetric and bits == 8:
        return -127, 127
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


_SCALE_DTYPES = {"float16": (torch.float16, FP16_MAX), "bfloat16": (torch.bfloat16, BF16_MAX_IN_FP16)}


def round_scale(scale: Tensor, scale_dtype: str = "float16") -> Tensor:
    """The smallest `scale_dtype` value >= scale (clamped to fp16's normal range), as float32.

    bfloat16 values in that range are exact in float16 too, so either kind is stored as float16."""
    dtype, largest = _SCALE_DTYPES[scale_dtype]
    s = scale.float().clamp(SCALE_MIN, largest)
    h = s.to(dtype)
    # Positive fp16/bf16 values are ordered like their bit patterns: +1 on the bits is the next value up.
    h = torch.where(h.float() < s, (h.view(torch.int16) + 1).view(dtype), h)
    return h.float()


def round_down_fp16(x: Tensor) -> Tensor:
    """The largest float16 value <= x (clamped to fp16's finite range), as float32."""
    x = x.float().clamp(-FP16_MAX, FP16_MAX)
    h = x.half()
    # One step down: towards -inf, i.e. the bits move away from zero for negatives, towards it for positives.
    step_down = torch.where(h.float() > 0, h.view(torch.int16) - 1, h.view(torch.int16) + 1)
    zero_down = torch.full_like(h, -(2.0**-24)).view(torch.int16)  # the next value below +-0
    step_down = torch.where(h.float() == 0, zero_down, step_down)
    return torch.where(h.float() > x, step_down.view(torch.float16), h).float()


def choose_qparams(w: Tensor, bits: int, symmetric: bool, scale_dtype: str = "float16",
                   float_zero: bool = False) -> tuple[Tensor, Tensor]:
    """Scale (fp16- or bf16-valued float32) and zero point of each row of `w` [..., g] -> [...]:
    an integral float, or with `float_zero` a float32 in code units (see the module docstring)."""
    qmin, qmax = qrange(bits, symmetric)
    w = w.float()
    if float_zero:
        dtype, largest = _SCALE_DTYPES[scale_dtype]
        if bits <= 4:
            step, bottom = least_squares_grid(w, qmax - qmin)
            low = round_down_fp16(bottom)
        else:  # 8 bits: a step is 1/255 of the range, and the sweep would need ~250 candidates
            low = round_down_fp16(w.amin(-1))
            step = (w.amax(-1) - low) / (qmax - qmin)
        # Rounded to nearest, not up: a group already on such a grid keeps its exact step (the top code
        # then lands within 2^-11 * (qmax - qmin) steps of the group maximum, far inside half a step;
        # bfloat16 scales, XNNPACK's, 2^-8 * 15 = 0.06 steps).
        scale = step.clamp(SCALE_MIN, largest).to(dtype).float()
        return scale, qmin - low / scale
    min_neg = w.amin(-1).clamp(max=0.0)  # [...]
    max_pos = w.amax(-1).clamp(min=0.0)
    if symmetric:
        scale = round_scale(torch.maximum(max_pos / qmax, min_neg / qmin), scale_dtype)
        if bits in SIGNED_SCALE_BITS:  # the mirrored grid [qmax * s, -qmin * s] for s < 0
            flipped = round_scale(torch.maximum(max_pos / -qmin, min_neg / -qmax), scale_dtype)
            scale = torch.where(flipped < scale, -flipped, scale)
        return scale, torch.zeros_like(scale)
    scale = round_scale((max_pos - min_neg) / (qmax - qmin), scale_dtype)
    zero = (qmin - torch.round(min_neg / scale)).clamp(qmin, qmax)
    if bits <= 4:
        scale, zero = exact_offset_scale(scale, min_neg, bits, scale_dtype)
    return scale, zero


# Candidate grids of the float-zero-point search, as the number of steps across a group's range:
# llama.cpp's k-quant sweep, from one step fewer to one more than the levels in tenths
# (make_qkx2_quants in ggml-quants.c), and every whole count from half the levels up, which finds a grid
# the weights already sit on when they do not reach its end codes (a Q4_K block seldom uses both 0 and 15).
def _step_counts(levels: int) -> list[float]:
    return [levels - 1 + 0.1 * i for i in range(21)] + [float(c) for c in range(levels // 2, levels - 1)]


_SEARCH_CHUNK = 1 << 16  # groups per pass of the search: its temporaries stay a few MB on any matrix


def least_squares_grid(w: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """(step, bottom) [...] of the grid bottom + step * {0, ..., levels} for each group of `w` [..., g],
    chosen to minimise the group's squared rounding error: for each candidate count of steps across the
    group's range, codes by rounding, then the step and bottom that fit those codes best (least
    squares, two normal equations in closed form), kept if that grid still covers the group. The
    min-max grid is a candidate too, so no group ends worse than under it (before the fp16 rounding of
    step and bottom). Letting the fit clip a group's extremes changed no perplexity on Gemma 3 270M
    (bench/results/gemma3.json, `fzp_search`), so the half-step bound of the module docstring holds.

    Groups the min-max grid already holds exactly (a checkpoint from Q4_1: every SmolLM2 matrix) skip
    the sweep: nothing can beat zero error, and the sweep is most of a build's quantization time."""
    flat = w.float().reshape(-1, w.shape[-1])  # [n, g]
    step, bottom, error = _min_max_grid(flat, levels)  # [n, 1] each
    # "Exact": off by less than a millionth of a step per weight, float32 rounding of d * q + m.
    todo = (error > flat.shape[-1] * (1e-6 * step) ** 2).squeeze(-1).nonzero().squeeze(-1)  # [m]
    for start in range(0, todo.numel(), _SEARCH_CHUNK):
        rows = todo[start: start + _SEARCH_CHUNK]
        s, b = _least_squares_chunk(flat[rows], levels, step[rows], bottom[rows], error[rows])
        step[rows], bottom[rows] = s, b
    return step.reshape(w.shape[:-1]), bottom.reshape(w.shape[:-1])


def _min_max_grid(x: Tensor, levels: int) -> tuple[Tensor, Tensor, Tensor]:  # x [n, g] -> 3 x [n, 1]
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = (hi - lo).clamp(min=SCALE_MIN) / levels
    codes = torch.round((x - lo) / step).clamp(0, levels)
    return step, lo, (codes * step + lo - x).square().sum(-1, keepdim=True)


def _least_squares_chunk(x: Tensor, levels: int, step: Tensor, bottom: Tensor, best: Tensor
                         ) -> tuple[Tensor, Tensor]:  # x [n, g], the min-max grid's [n, 1] -> [n, 1] x 2
    g = x.shape[-1]
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    span = (hi - lo).clamp(min=SCALE_MIN)
    sum_x = x.sum(-1, keepdim=True)
    for count in _step_counts(levels):
        codes = torch.round((x - lo) * (count / span)).clamp(0, levels)  # [n, g]
        sum_c, sum_cc = codes.sum(-1, keepdim=True), codes.square().sum(-1, keepdim=True)
        sum_xc = (codes * x).sum(-1, keepdim=True)
        det = g * sum_cc - sum_c * sum_c  # 0 when every code is the same: no step to fit
        solvable = det > 0
        det = torch.where(solvable, det, torch.ones_like(det))
        s = (g * sum_xc - sum_x * sum_c) / det
        b = (sum_cc * sum_x - sum_c * sum_xc) / det
        e = (codes * s + b - x).square().sum(-1, keepdim=True)
        # The grid must still hold the whole group, to a thousandth of a step (the fit's float error;
        # the fp16 rounding of the step moves its top more): every weight stays within half a step.
        slack = 1e-3 * s
        covers = (b <= lo + slack) & (b + levels * s >= hi - slack)
        better = solvable & (s > 0) & covers & (e < best)
        step, bottom, best = torch.where(better, s, step), torch.where(better, b, bottom), torch.where(better, e, best)
    return step, bottom


def exact_offset_scale(scale: Tensor, min_neg: Tensor, bits: int, scale_dtype: str = "float16"
                       ) -> tuple[Tensor, Tensor]:
    """Asymmetric (scale, zero) with scale * (zero + 2^(b-1)) exact in fp16 (GGUF Q4_1's block minimum).

    Each scale not yet exact moves up one fp16 (bf16) step at a time and its zero point is re-chosen;
    a scale whose lowest 4 significand bits are zero always works, so 16 steps suffice for 4 bits.
    A larger scale still covers the group's range, so nothing clips."""
    qmin, qmax = qrange(bits, False)
    dtype = _SCALE_DTYPES[scale_dtype][0]
    offset = 1 << (bits - 1)

    def zero_of(s: Tensor) -> Tensor:
        return (qmin - torch.round(min_neg / s)).clamp(qmin, qmax)

    def exact(s: Tensor, z: Tensor) -> Tensor:
        m = s * (z + offset)  # exact in float32: 11 + 4 significant bits
        return m.half().float() == m

    zero = zero_of(scale)
    for _ in range(16):
        todo = ~exact(scale, zero)
        if not todo.any():
            break
        up = (scale.to(dtype).view(torch.int16) + 1).view(dtype).float()  # the next value up (positive)
        scale = torch.where(todo, up, scale)
        zero = torch.where(todo, zero_of(scale), zero)
    return scale, zero


def scale_storage_dtype(fmt: WeightFormat) -> torch.dtype:
    """How group scales are stored: float16, or float32 for K-quant super-blocks (d * level)."""
    return torch.float32 if fmt.super_block else torch.float16


def group_qparams(groups: Tensor, fmt: WeightFormat) -> tuple[Tensor, Tensor]:
    """Scale and zero point [N, G] of every group of a matrix `groups` [N, G, g] in format `fmt`."""
    if fmt.super_block:
        return superblock_qparams(groups, fmt)
    return choose_qparams(groups, fmt.bits, fmt.symmetric, fmt.scale_dtype, fmt.float_zero)


def _fp16_nearest(x: Tensor) -> Tensor:
    return x.half().float()


def superblock_qparams(groups: Tensor, fmt: WeightFormat) -> tuple[Tensor, Tensor]:
    """K-quant (scale, zero) [N, G] of `groups` [N, G, g] (see the module docstring): the groups' own
    parameters, then their scales (and minima) as integer levels of one fp16 step per super-block."""
    N, G, g = groups.shape
    per = fmt.super_block // g  # groups per super-block
    if G % per:
        raise ValueError(f"{G * g} columns are not whole super-blocks of {fmt.super_block}")
    qmin, qmax = qrange(fmt.bits, fmt.symmetric)
    w = groups.float()
    if fmt.float_zero:  # Q4_K: x = d * sc * q - dmin * mc, q in 0..15, sc and mc in 0..63
        step, bottom = least_squares_grid(w, qmax - qmin)  # [N, G]
        above = bottom > 0  # minima are stored as -dmin * mc <= 0: such a group takes the grid from 0 up
        step = torch.where(above, w.amax(-1) / (qmax - qmin), step).clamp(min=SCALE_MIN)
        d, sc = _levels(step.reshape(N, -1, per), 63, low=1)  # [N, S, 1], [N, S, per]
        dmin, mc = _levels((-bottom).clamp(min=0).reshape(N, -1, per), 63, low=0)
        scale, dmin = (d * sc).reshape(N, G), dmin.expand(-1, -1, per).reshape(N, G)  # scale exact in float32
        mc = _nearest_lattice_minimum(w, scale, bottom, dmin, mc.reshape(N, G), qmax - qmin)
        return scale, qmin + dmin * mc / scale
    # Q6_K: x = d * sc * q, q in -32..31, sc in -128..127: the largest magnitude of a group on -32, or
    # the finest step that holds the group exactly (a group read from a Q6_K file)
    S = symmetric_group_steps(w, qmin, qmax).reshape(N, -1, per)
    lead = S.gather(-1, S.abs().argmax(-1, keepdim=True))  # [N, S, 1]: the super-block's largest scale
    d = _fp16_nearest(lead / -128)
    d = torch.where(d == 0, torch.full_like(d, -(2.0**-24)) * lead.sign(), d)
    sc = torch.round(S / d).clamp(-128, 127)
    sc = torch.where(sc == 0, torch.where(S / d < 0, -1.0, 1.0), sc)  # never a zero scale
    sc = torch.where(S == lead, torch.full_like(sc, -128.0), sc)
    return (d * sc).reshape(N, G), torch.zeros(N, G)


def symmetric_group_steps(w: Tensor, qmin: int, qmax: int) -> Tensor:
    """Signed step [...] of each group of `w` [..., g]: the smallest in magnitude on which every weight is
    a code in qmin..qmax (to a thousandth of a step: float32 products), its largest magnitude on a negative
    code; where none is, the largest magnitude on qmin (llama.cpp's -nmax / max)."""
    top = w.gather(-1, w.abs().argmax(-1, keepdim=True))  # [..., 1], signed
    fallback = torch.where(top == 0, torch.full_like(top, SCALE_MIN), top / qmin).squeeze(-1)
    best = torch.full_like(fallback, float("inf"))
    for code in range(qmin, 0):  # the top's code: -32 (the finest step) up to -1
        step = top / code
        q = w / step
        fits = ((q - q.round()).abs() <= 1e-3).all(-1) & (q.round() >= qmin).all(-1) & (q.round() <= qmax).all(-1)
        fits = fits & (top.squeeze(-1) != 0) & torch.isinf(best)
        best = torch.where(fits, step.squeeze(-1), best)
    return torch.where(torch.isinf(best), fallback, best)


def _nearest_lattice_minimum(w: Tensor, scale: Tensor, bottom: Tensor, dmin: Tensor, mc: Tensor,
                             levels: int) -> Tensor:
    """Minimum levels [N, G] of K-quant groups `w` [N, G, g]: the grids bottom - k * scale (k >= 0 steps
    lower) are one lattice, each with its minimum rounded to a level of `dmin`; each group takes the
    one with the least squared error over its weights (k = 0 on a tie). A group that never reached
    code 0 (a Q4_K block) thereby gets its source's minimum back, and other weights lose nothing. The
    super-block's level-63 groups stay put (the writer recovers dmin from them)."""
    k = torch.arange(levels + 1, dtype=w.dtype)  # [K]
    safe = torch.where(dmin > 0, dmin, torch.ones_like(dmin))[..., None]
    levels_k = torch.round((k * scale[..., None] - bottom[..., None]) / safe).clamp(0, 63)  # [N, G, K]
    grid = (-levels_k * dmin[..., None])[..., None]  # [N, G, K, 1]
    s = scale[..., None, None]
    codes = torch.round((w[..., None, :] - grid) / s).clamp(0, levels)  # [N, G, K, g]
    error = (codes * s + grid - w[..., None, :]).square().sum(-1)  # [N, G, K]
    error = error + torch.where(k == 0, 0.0, 1e-9 * error[..., :1])  # ties: the plain grid
    best = levels_k.gather(-1, error.argmin(-1, keepdim=True)).squeeze(-1)
    return torch.where((mc == 63) | (dmin == 0), mc, best)


def _levels(values: Tensor, top: int, low: int) -> tuple[Tensor, Tensor]:
    """(fp16 step [..., 1], integer levels [..., n] in low..top) of non-negative `values` [..., n]: the
    largest value on level `top` (so the step is recoverable as largest / top), the rest to nearest."""
    peak = values.amax(-1, keepdim=True)
    step = _fp16_nearest(peak / top)
    step = torch.where(step > 0, step, torch.where(peak > 0, torch.full_like(step, 2.0**-24), step))
    safe = torch.where(step > 0, step, torch.ones_like(step))
    levels = torch.round(values / safe).clamp(low, top)
    levels = torch.where((values == peak) & (peak > 0), torch.full_like(levels, float(top)), levels)
    return step, levels


def quantize_with(w: Tensor, scale: Tensor, zero: Tensor, bits: int, symmetric: bool,
                  float_zero: bool = False) -> Tensor:
    """Codes (float, integral) of `w` [..., g] with per-row scale/zero [...] (or broadcastable)."""
    qmin, qmax = qrange(bits, symmetric)
    if scale.dim() == w.dim() - 1:
        scale, zero = scale[..., None], zero[..., None]
    if float_zero:  # the nearest grid point of a grid that starts at a float offset
        return torch.round(w.float() / scale + zero).clamp(qmin, qmax)
    return (torch.round(w.float() / scale) + zero).clamp(qmin, qmax)


def zero_dtype(fmt: WeightFormat) -> torch.dtype:
    """How zero points are stored: int8 codes, or float32 code units for a float zero point."""
    return torch.float32 if fmt.float_zero else torch.int8


def quantize_int(w: Tensor, fmt: WeightFormat, where: str = "this layer") -> IntWeights:
    """Round-to-nearest groupwise quantization of `w` [N, K]."""
    N, K = w.shape
    g = fmt.group_for(K, where)
    groups = w.detach().float().reshape(N, K // g, g)  # [N, G, g]
    scale, zero = group_qparams(groups, fmt)  # [N, G]
    codes = quantize_with(groups, scale, zero, fmt.bits, fmt.symmetric, fmt.float_zero)
    return IntWeights(codes.reshape(N, K).to(torch.int8), scale.to(scale_storage_dtype(fmt)),
                      zero.to(zero_dtype(fmt)))


def dequantize_int(codes: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """float32 [N, K] from codes [N, K] and per-group scales/zeros [N, G] (group size K // G)."""
    N, K = codes.shape
    G = scales.shape[1]
    q = codes.float().reshape(N, G, K // G)
    return ((q - zeros.float()[..., None]) * scales.float()[..., None]).reshape(N, K)


def quantize_fp8(w: Tensor) -> Fp8Weights:
    """float8 e4m3 codes with one fp32 scale per row (amax maps to 448)."""
    w = w.detach().float()
    scale = (w.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=FP8_SCALE_MIN)  # [N, 1]
    codes = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weights(codes, scale)


def dequantize_fp8(codes: Tensor, scales: Tensor) -> Tensor:
    return codes.float() * scales.float()


def fake_quant_per_token_int8(x: Tensor) -> Tensor:
    """Quantize-dequantize activations [..., K] to asymmetric int8 per token (row), like XNNPACK's
    dynamic quantization and torchao's `int8_asym_per_token` (same formula, same rounding)."""
    qmin, qmax = -128, 127
    min_neg = x.amin(-1, keepdim=True).clamp(max=0.0)
    max_pos = x.amax(-1, keepdim=True).clamp(min=0.0)
    scale = ((max_pos - min_neg) / float(qmax - qmin)).clamp(min=torch.finfo(x.dtype).smallest_normal)
    zero = (qmin - torch.round(min_neg / scale)).clamp(qmin, qmax)
    q = (torch.round(x * (1.0 / scale)) + zero).clamp(qmin, qmax)
    return (q - zero) * scale


# The clipped part's top, in units of its bottom: a row clipped on both sides spans [-limit, limit * 127/128],
# whose int8 step puts both ends on whole codes (-128 and 127) and the zero point on 0. Clipped at +-limit,
# each end would fall half-way between two codes (127.5 steps from zero), and XNNPACK and torch round
# such ties apart (measured: 0.04-0.09 logits apart on a tiny model where unsplit programs agree to 1e-6).
CLIP_TOP = 127 / 128


def split_outliers(x: Tensor, ratio: int) -> tuple[Tensor, Tensor]:
    """Activations [..., K] as two parts that sum to them exactly (x = clipped + outliers): each token's
    values clipped at 1/ratio of its largest magnitude, and what lies beyond (zero elsewhere).

    Quantized per token on their own, the clipped part gets a step `ratio` times finer and the outliers
    their own; the few channels that set one token's int8 step (Gemma 3's residual stream and MLP
    carry channels 5-9x the median group) no longer round all the others. Two int8 rows through the
    same weights: for a decode token a 2-row GEMM, which reads the weights once, like a 1-row one."""
    peak = x.abs().amax(-1, keepdim=True)  # [..., 1]
    limit = peak * (1.0 / ratio)
    clipped = torch.minimum(torch.maximum(x, -limit), limit * CLIP_TOP)
    return clipped, x - clipped


def int_error_bound(scales: Tensor, group_size: int) -> Tensor:
    """Largest |w - dequant(quant(w))| of round-to-nearest per element [N, K]: half a step (the
    1e-6 covers the float32 rounding of w / scale)."""
    return (scales.float().abs() * 0.5 * (1 + 1e-6)).repeat_interleave(group_size, dim=1)
