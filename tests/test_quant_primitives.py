"""Quantization arithmetic: every scheme stays within its theoretical error bound, incl. edge cases."""

import pytest
import torch

from edgefinfer.compile.quant.primitives import (SCALE_MIN, choose_qparams, dequantize_fp8, dequantize_int,
                                                 fake_quant_per_token_int8, int_error_bound, qrange, quantize_fp8,
                                                 quantize_int, round_scale)
from edgefinfer.compile.quant.recipe import WeightFormat


def nasty_matrix(n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    """Gaussian weights plus the cases that break naive quantizers."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :128] = 0.0  # all-zero groups (for every group size up to 128)
    w[1] = 0.0  # an all-zero row
    w[:, 7] *= 80.0  # outlier input channels, as activations-heavy models have
    w[:, k - 56] *= -120.0
    w[2, 64:128] = 1e-6 * torch.randn(w[2, 64:128].numel(), generator=g)  # far below fp16's normal range
    w[3, :] = torch.linspace(0.01, 0.02, k)  # strictly positive rows: asymmetric must still include 0
    return w


FORMATS = [WeightFormat("int", b, g, s) for b in (8, 4, 3, 2) for g in (32, 64, 128, None) for s in (True, False)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label())
def test_round_to_nearest_is_within_half_a_step(fmt):
    w = nasty_matrix()
    q = quantize_int(w, fmt)
    g = fmt.group_for(w.shape[1])
    deq = dequantize_int(*q)
    assert q.codes.dtype == torch.int8 and q.scales.dtype == torch.float16 and q.zeros.dtype == torch.int8
    qmin, qmax = qrange(fmt.bits, fmt.symmetric)
    assert q.codes.min() >= qmin and q.codes.max() <= qmax
    assert q.zeros.min() >= qmin and q.zeros.max() <= qmax
    if fmt.symmetric:
        assert (q.zeros == 0).all()
    assert ((w - deq).abs() <= int_error_bound(q.scales, g)).all()
    # The bound is tight, not vacuous: the step is the range over the levels, rounded up to fp16.
    groups = w.reshape(w.shape[0], -1, g)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    ideal = torch.maximum(hi / qmax, lo / qmin) if fmt.symmetric else (hi - lo) / (qmax - qmin)
    slack = 1 + 2**-10 if fmt.symmetric or fmt.bits > 4 else (1 + 2**-10) * (1 + 2**-6)  # + Q4_1's 16 fp16 steps
    assert (q.scales.float() <= torch.maximum(ideal * slack, torch.tensor(SCALE_MIN))).all()
    # Zero stays exactly zero (all-zero groups, the zero row).
    assert (deq[0, :128] == 0).all() and (deq[1] == 0).all()


def test_scales_round_up_to_float16():
    s = torch.tensor([1e-9, 0.1, 0.3333, 7.0, 1e6])
    r = round_scale(s)
    assert (r >= s.clamp(SCALE_MIN, 65504)).all()
    assert torch.equal(r, r.half().float())  # exactly representable in fp16
    assert r[0].item() == SCALE_MIN and r[-1].item() == 65504.0
    assert r[2].item() == pytest.approx(0.3333, rel=2**-10)


def test_bfloat16_scales_for_xnnpack():
    w = nasty_matrix()
    fmt = WeightFormat("int", 4, 32, True, "bfloat16")
    q = quantize_int(w, fmt)
    s = q.scales.float()
    assert torch.equal(s, s.bfloat16().float())  # bf16 values, held exactly by the fp16 buffer
    assert ((w - dequantize_int(*q)).abs() <= int_error_bound(q.scales, 32)).all()
    fp16 = quantize_int(w, WeightFormat("int", 4, 32, True)).scales.float()
    assert (s >= fp16).all() and (s <= fp16 * (1 + 2**-7)).all()  # rounded up, at most one bf16 step


def test_symmetric_int4_uses_minus_eight_like_gguf():
    w = torch.tensor([[-8.0, 1.0, 7.0, 0.0] * 8])
    q = quantize_int(w, WeightFormat("int", 4, 32, True))
    assert q.scales.item() == 1.0 and q.codes.min().item() == -8 and q.codes.max().item() == 7
    assert torch.equal(dequantize_int(*q), w)


def test_symmetric_int8_stays_in_the_restricted_range():
    w = torch.tensor([[-1.0, 0.5] * 16])
    q = quantize_int(w, WeightFormat("int", 8, 32, True))
    assert q.codes.min().item() == -127  # never -128: XNNPACK and GGUF Q8_0 expect [-127, 127]


def test_choose_qparams_asymmetric_range_contains_zero():
    w = torch.full((1, 32), 5.0)
    s, z = choose_qparams(w, 4, False)
    assert z.item() == -8  # the grid starts at 0 so that 0 is exact
    assert torch.equal(dequantize_int(torch.full((1, 32), 7, dtype=torch.int8), s.half()[None], z.to(torch.int8)[None]),
                       torch.full((1, 32), 15 * s.item()))


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_asymmetric_offset_is_an_fp16_value(bits):
    """GGUF Q4_1 stores m = -d * (zero + 8) in fp16: our scales make that product exact, at a cost of
    well under one percent of a step (a plain fp16 scale makes it inexact for most groups)."""
    w = torch.cat([nasty_matrix(), torch.randn(512, 256) * 0.05])
    fmt = WeightFormat("int", bits, 32, False)
    q = quantize_int(w, fmt)
    m = q.scales.float() * (q.zeros.float() + 2 ** (bits - 1))
    assert torch.equal(m.half().float(), m)
    groups = w.reshape(w.shape[0], -1, 32)
    ideal = ((groups.amax(-1).clamp(min=0) - groups.amin(-1).clamp(max=0)) / (2**bits - 1)).clamp(min=SCALE_MIN)
    assert (q.scales.float() / ideal).mean() < 1 + 2**-8
    plain = round_scale(ideal)
    plain_m = plain * ((-(2 ** (bits - 1)) - torch.round(groups.amin(-1).clamp(max=0) / plain)) + 2 ** (bits - 1))
    if bits == 4:
        assert (plain_m.half().float() != plain_m).float().mean() > 0.3


def test_fp8_is_within_e4m3_rounding():
    w = nasty_matrix()
    q = quantize_fp8(w)
    assert q.codes.dtype == torch.float8_e4m3fn and q.scales.shape == (w.shape[0], 1)
    deq = dequantize_fp8(*q)
    # 3 mantissa bits: relative error <= 2^-4 for normals; below 2^-6 the subnormal step is 2^-9.
    bound = torch.maximum(w.abs() * 2**-4, q.scales * 2**-10) * (1 + 1e-6)
    assert ((w - deq).abs() <= bound).all()
    assert (deq[1] == 0).all()
    assert torch.allclose((w.abs().amax(-1) / q.scales.squeeze(1))[2:], torch.tensor(448.0))


def test_activation_fake_quant_per_token():
    x = torch.randn(3, 5, 64) * torch.tensor([1.0, 10.0, 0.01])[:, None, None]
    y = fake_quant_per_token_int8(x)
    step = (x.amax(-1, keepdim=True).clamp(min=0) - x.amin(-1, keepdim=True).clamp(max=0)) / 255
    assert ((x - y).abs() <= step * 0.5 * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(fake_quant_per_token_int8(torch.zeros(2, 8)), torch.zeros(2, 8))


def test_activation_fake_quant_matches_torchao():
    ao = pytest.importorskip("torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor")
    x = torch.randn(4, 7, 96) * 3 + 0.5
    x[0, 0] = 0.0
    assert torch.equal(fake_quant_per_token_int8(x), ao._apply_int8_act_asym_per_token_quant_dequant(x))


def test_codes_match_torchao_quantize_affine_with_our_qparams():
    qp = pytest.importorskip("torchao.quantization.quant_primitives")
    w = nasty_matrix()
    formats = (WeightFormat("int", 4, 32, False), WeightFormat("int", 4, 64, True), WeightFormat("int", 8, None, True))
    for fmt in formats:
        q = quantize_int(w, fmt)
        g = fmt.group_for(w.shape[1])
        qmin, qmax = qrange(fmt.bits, fmt.symmetric)
        ref = qp.quantize_affine(w, (1, g), q.scales.float(), q.zeros, torch.int8, qmin, qmax)
        assert torch.equal(ref, q.codes), fmt.label()
        back = qp.dequantize_affine(q.codes, (1, g), q.scales.float(), q.zeros, torch.int8, qmin, qmax)
        assert torch.equal(back, dequantize_int(*q)), fmt.label()


FLOAT_ZERO_FORMATS = [WeightFormat("int", b, g, False, float_zero=True) for b in (8, 4, 3) for g in (32, 128, None)]


@pytest.mark.parametrize("fmt", FLOAT_ZERO_FORMATS, ids=lambda f: f.label())
def test_float_zero_point_is_within_half_a_step(fmt):
    """-fzp: the grid starts at the group's fp16 minimum; every weight within half a step, codes in
    range, zero points float32 code units (not integral in general)."""
    w = nasty_matrix()
    q = quantize_int(w, fmt)
    g = fmt.group_for(w.shape[1])
    assert q.codes.dtype == torch.int8 and q.zeros.dtype == torch.float32
    qmin, qmax = qrange(fmt.bits, False)
    assert q.codes.min() >= qmin and q.codes.max() <= qmax
    assert (q.zeros != q.zeros.round()).any()
    assert ((w - dequantize_int(*q)).abs() <= int_error_bound(q.scales, g)).all()
    # The grid holds the whole group: its bottom at or below the minimum (fp16, rounded down), its top
    # within half a step of the maximum (the step is rounded to the nearest fp16).
    groups = w.reshape(w.shape[0], -1, g)
    step = q.scales.float()
    low = -step * (q.zeros - qmin)
    assert (low <= groups.amin(-1) + 1e-7).all()
    assert (low + (qmax - qmin) * step >= groups.amax(-1) - step / 2).all()


@pytest.mark.parametrize("levels", [15, 7])
def test_least_squares_grid_never_loses_to_the_min_max_grid(levels):
    """The searched grid's squared error is at most the min-max grid's in every group (the min-max grid
    is a candidate), strictly less on some Gaussian groups, and it still covers each group."""
    from edgefinfer.compile.quant.primitives import least_squares_grid
    w = nasty_matrix().reshape(-1, 32)
    step, bottom = least_squares_grid(w, levels)

    def sq_error(step, bottom):
        codes = torch.round((w - bottom[:, None]) / step[:, None]).clamp(0, levels)
        return (codes * step[:, None] + bottom[:, None] - w).square().sum(-1)

    lo, hi = w.amin(-1), w.amax(-1)
    searched, min_max = sq_error(step, bottom), sq_error((hi - lo).clamp(min=2.0**-14) / levels, lo)
    assert (searched <= min_max * (1 + 1e-5) + 1e-12).all()
    nonzero = min_max > 0
    assert (searched[nonzero] / min_max[nonzero]).mean() < 0.95  # ~0.91 here: the search does something
    assert (bottom <= lo + 1e-3 * step).all() and (bottom + levels * step >= hi - 1e-3 * step).all()


def test_float_zero_point_keeps_weights_on_a_grid_whose_end_codes_are_unused():
    """A Q4_K block seldom uses both code 0 and code 15: its weights sit on a grid wider than their range.
    The search finds that grid (error ~0) where the min-max grid, spread over the range alone, cannot."""
    g = torch.Generator().manual_seed(3)
    n = 64
    d = (torch.rand(n, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (-d * 8).half().float()
    q = torch.randint(2, 12, (n, 32), generator=g).float()  # codes 2..11 of 0..15
    q[:, 0], q[:, 1] = 2, 11
    w = d * q + m
    fmt = WeightFormat("int", 4, 32, False, float_zero=True)
    searched = dequantize_int(*quantize_int(w, fmt))
    assert ((searched - w).abs() / d).max() < 1e-2
    from edgefinfer.compile.quant.primitives import _min_max_grid
    step, lo, _ = _min_max_grid(w, 15)
    min_max = torch.round((w - lo) / step).clamp(0, 15) * step + lo
    assert ((min_max - w).abs() / d).mean() > 0.05  # what the range's grid costs on the same weights


def q4_1_grid(n: int = 64, k: int = 256, seed: int = 1) -> torch.Tensor:
    """Weights as a Q4_1 GGUF holds them: x = d * q + m per block of 32, fp16 d and m, q in 0..15
    with both ends used (llama.cpp sets m to the block minimum and d to the range over 15)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (-d * (torch.rand(n, k // 32, 1, generator=g) * 15)).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).reshape(n, k)


def test_float_zero_point_keeps_weights_that_sit_on_a_q4_1_grid():
    """A checkpoint distributed as Q4_1 (the reference model) keeps its weights under int4-g32-fzp
    (to float32 rounding), where an integer zero point must move them by up to half a step."""
    w = q4_1_grid()
    fzp = dequantize_int(*quantize_int(w, WeightFormat("int", 4, 32, False, float_zero=True)))
    assert (fzp - w).abs().max() <= 1e-6 * w.abs().max()
    step = quantize_int(w, WeightFormat("int", 4, 32, False)).scales.float().repeat_interleave(32, 1)
    integer = dequantize_int(*quantize_int(w, WeightFormat("int", 4, 32, False)))
    assert ((integer - w).abs() / step).mean() > 0.1  # what the integer grid costs on the same weights


def test_round_down_fp16():
    from edgefinfer.compile.quant.primitives import round_down_fp16
    x = torch.tensor([1.0, 1.0 + 2**-12, -(1.0 + 2**-12), 0.0, 1e-9, -1e-9, -70000.0, 3.3e-5])
    r = round_down_fp16(x)
    assert torch.equal(r.half().float(), r)
    assert (r[[0, 1, 2, 3, 4, 5, 7]] <= x[[0, 1, 2, 3, 4, 5, 7]]).all()  # -70000 clamps to fp16's finite range
    assert r[0] == 1.0 and r[1] == 1.0 and r[2] == -(1.0 + 2**-10) and r[3] == 0.0
    assert r[5] < 0 and r[6] == -65504.0
    assert ((x - r)[:3].abs() <= 2**-10 * x[:3].abs()).all()
