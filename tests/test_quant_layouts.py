"""Re-packing for the exporters is bit-exact: GGUF Q4_0/Q8_0 (gguf-py), ONNX MatMulNBits (onnxruntime),
torchao / ExecuTorch 8da4w (IntxUnpackedToInt8Tensor)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgefinfer.compile.quant.layouts import (matmulnbits_reference, to_gguf_q4_0, to_gguf_q4_1, to_gguf_q4_k,
                                              to_gguf_q5_k, to_gguf_q6_k, to_gguf_q8_0, to_matmulnbits, to_torchao,
                                              torchao_model)
from edgefinfer.compile.quant.modules import QuantLinear
from edgefinfer.compile.quant.primitives import quantize_int
from edgefinfer.compile.quant.recipe import WeightFormat, parse_recipe
from edgefinfer.errors import UserError
from tests.test_quant_primitives import nasty_matrix


def qlinear(fmt: WeightFormat, n: int = 48, k: int = 256, act_quant: bool = False, seed: int = 0,
            w: torch.Tensor | None = None) -> QuantLinear:
    w = nasty_matrix(n, k, seed) if w is None else w
    n, k = w.shape
    lin = nn.Linear(k, n, bias=False)
    lin.weight.data = w
    return QuantLinear.from_float(lin, fmt, quantize_int(w, fmt), act_quant)


# ---- GGUF -------------------------------------------------------------------------------------------------

def test_q4_0_bytes_decode_to_our_weights():
    gguf = pytest.importorskip("gguf")
    m = qlinear(WeightFormat("int", 4, 32, True))
    raw = to_gguf_q4_0(m)
    assert raw.dtype == np.uint8 and raw.shape == (48, 256 // 32 * 18)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(deq, m.dequantized().numpy())


def test_q4_1_bytes_decode_to_our_asymmetric_weights():
    """Q4_1 decodes nibble * d + m: with d our scale and m = -d * (zero + 8), bit for bit ours."""
    gguf = pytest.importorskip("gguf")
    m = qlinear(WeightFormat("int", 4, 32, False), n=512)
    assert (m.zeros != 0).any()  # really asymmetric
    raw = to_gguf_q4_1(m)
    assert raw.dtype == np.uint8 and raw.shape == (512, 256 // 32 * 20)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)
    assert np.array_equal(deq, m.dequantized().numpy())


def test_q4_1_holds_a_float_zero_point_as_its_block_minimum():
    """-fzp's zero point is the group's fp16 minimum: Q4_1 stores it as m and decodes our weights to
    float32 rounding (d * nibble + m against (q - z) * d)."""
    gguf = pytest.importorskip("gguf")
    m = qlinear(WeightFormat("int", 4, 32, False, float_zero=True), n=512)
    deq = gguf.quants.dequantize(to_gguf_q4_1(m), gguf.GGMLQuantizationType.Q4_1)
    want = m.dequantized().numpy()
    assert np.abs(deq - want).max() <= 1e-6 * np.abs(want).max()


def test_q8_0_bytes_decode_to_our_weights():
    gguf = pytest.importorskip("gguf")
    m = qlinear(WeightFormat("int", 8, 32, True))
    raw = to_gguf_q8_0(m)
    assert raw.shape == (48, 256 // 32 * 34)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(deq, m.dequantized().numpy())


def test_q4_0_layout_matches_gguf_quantizer_on_its_own_grid():
    # Weights already on a Q4_0 grid: gguf-py's quantizer and our re-packing give the same bytes.
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    codes = rng.integers(-8, 8, size=(8, 64)).astype(np.float32)
    codes[:, ::32] = -8  # the block's largest magnitude is negative, as Q4_0 maps it to -8
    d = np.repeat(rng.uniform(0.5, 2, size=(8, 2)).astype(np.float16).astype(np.float32), 32, axis=1)
    w = codes * d
    m = qlinear(WeightFormat("int", 4, 32, True), w=torch.from_numpy(w))
    assert np.array_equal(to_gguf_q4_0(m), gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0))


Q4_K = WeightFormat("int", 4, 32, False, float_zero=True, super_block=256)
Q5_K = WeightFormat("int", 5, 32, False, float_zero=True, super_block=256)
Q6_K = WeightFormat("int", 6, 16, True, super_block=256)


@pytest.mark.parametrize("fmt, fn, block", [(Q4_K, to_gguf_q4_k, 144), (Q5_K, to_gguf_q5_k, 176)],
                         ids=["Q4_K", "Q5_K"])
def test_q4_k_and_q5_k_bytes_decode_to_our_weights(fmt, fn, block):
    """Q4_K / Q5_K decode d * sc * u - dmin * mc per group of 32: our weights to float32 rounding (ours
    compute (q - z) * scale), with 6-bit levels of two fp16 steps per 256 weights."""
    gguf = pytest.importorskip("gguf")
    m = qlinear(fmt, n=64, k=512)
    assert m.scales.dtype == torch.float32  # d * sc: up to 17 significant bits
    raw = fn(m)
    assert raw.dtype == np.uint8 and raw.shape == (64, 2 * block)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[f"Q{fmt.bits}_K"])
    want = m.dequantized().numpy()
    assert np.abs(deq - want).max() <= 1e-6 * np.abs(want).max()
    assert m.packed_bytes() == raw.nbytes
    assert (m.qweight.min(), m.qweight.max()) == (-(1 << (fmt.bits - 1)), (1 << (fmt.bits - 1)) - 1)  # every code


def test_q6_k_bytes_decode_to_our_weights_bit_for_bit():
    gguf = pytest.importorskip("gguf")
    m = qlinear(Q6_K, n=64, k=512)
    raw = to_gguf_q6_k(m)
    assert raw.shape == (64, 2 * 210) and m.packed_bytes() == raw.nbytes
    assert (m.scales < 0).any() and (m.scales > 0).any()  # signed levels: the largest magnitude on code -32
    assert np.array_equal(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K), m.dequantized().numpy())


def test_k_quants_refuse_scales_that_are_not_super_blocks():
    m = qlinear(Q4_K, n=8, k=256)
    m.scales[0, 3] *= 1.001  # no longer an fp16 step times an integer level
    with pytest.raises(UserError, match="not K-quant super-blocks.*re-quantize"):
        to_gguf_q4_k(m)
    with pytest.raises(UserError, match="Q6_K holds int6-g16-sym"):
        to_gguf_q6_k(qlinear(WeightFormat("int", 8, 32, True), n=8, k=256))


@pytest.mark.parametrize("fmt,fn", [(WeightFormat("int", 4, 32, False), to_gguf_q4_0),
                                    (WeightFormat("int", 4, 64, True), to_gguf_q4_0),
                                    (WeightFormat("int", 8, None, True), to_gguf_q8_0),
                                    (WeightFormat("int", 4, 32, True), to_gguf_q8_0),
                                    (WeightFormat("int", 4, 32, True), to_gguf_q4_1),
                                    (WeightFormat("int", 4, 64, False), to_gguf_q4_1)])
def test_gguf_refuses_formats_it_cannot_hold(fmt, fn):
    with pytest.raises(UserError, match="symmetric .*blocks of 32.*recipe int"):
        fn(qlinear(fmt))


# ---- ONNX Runtime MatMulNBits ------------------------------------------------------------------------------

MNB_FORMATS = [WeightFormat("int", b, g, s) for b in (4, 8, 2) for g in (32, 64, 128) for s in (True, False)]


@pytest.mark.parametrize("fmt", MNB_FORMATS, ids=lambda f: f.label())
def test_matmulnbits_packing_is_lossless(fmt):
    m = qlinear(fmt)
    packed = to_matmulnbits(m)
    assert packed.B.shape == (48, 256 // fmt.group_size, fmt.group_size * fmt.bits // 8)
    assert (packed.zero_points is None) == fmt.symmetric
    assert np.array_equal(matmulnbits_reference(packed), m.dequantized().numpy())


def test_matmulnbits_nibble_order_is_low_first():
    m = qlinear(WeightFormat("int", 4, 32, False), w=torch.randn(1, 32))
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(2)[None]  # [1, 32]
    m.qweight = codes
    m.zeros = torch.tensor([[-3]], dtype=torch.int8)
    packed = to_matmulnbits(m)
    assert packed.B[0, 0, 0] == 0x10  # codes -8, -7 -> unsigned 0, 1: element 0 in the low nibble
    assert packed.B[0, 0, 7] == 0xFE  # codes 6, 7 -> 14, 15
    assert packed.zero_points.tolist() == [[5]]  # -3 + 8, low nibble; the high nibble is padding


def _run_matmulnbits(packed, a: np.ndarray) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(packed.B, "B"), numpy_helper.from_array(packed.scales, "scales")]
    inputs = ["A", "B", "scales"]
    if packed.zero_points is not None:
        inits.append(numpy_helper.from_array(packed.zero_points, "zero_points"))
        inputs.append("zero_points")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", accuracy_level=0,
                            **packed.attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, packed.K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, packed.N])], inits)
    model = helper.make_model(graph, ir_version=10,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": a})[0]


@pytest.mark.parametrize("fmt", [WeightFormat("int", 4, 32, True), WeightFormat("int", 4, 64, False),
                                 WeightFormat("int", 4, 128, False), WeightFormat("int", 8, 32, True),
                                 WeightFormat("int", 8, 64, False)], ids=lambda f: f.label())
def test_onnxruntime_matmulnbits_computes_our_weights(fmt):
    m = qlinear(fmt)
    packed = to_matmulnbits(m)
    # Identity input: every output is one exact product, so ORT's dequantized weights come back bit-exact.
    eye = np.eye(packed.K, dtype=np.float32)
    assert np.array_equal(_run_matmulnbits(packed, eye), m.dequantized().numpy().T)
    x = torch.randn(5, packed.K)
    np.testing.assert_allclose(_run_matmulnbits(packed, x.numpy()), m(x).detach().numpy(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", [WeightFormat("int", 4, 32, False, float_zero=True),
                                 WeightFormat("int", 4, 128, False, float_zero=True),
                                 WeightFormat("int", 8, 64, False, float_zero=True)], ids=lambda f: f.label())
def test_float_zero_point_splits_into_symmetric_matmulnbits_plus_group_offsets(fmt):
    """-fzp on ONNX Runtime: MatMulNBits' fast symmetric kernel on q * d, plus group_sums(x) @ m^T;
    together they compute the module (ORT's own float zero points take a slow unpacked path)."""
    m = qlinear(fmt)
    packed = to_matmulnbits(m)
    assert packed.zero_points is None
    sym, offsets = m.offset_split()
    assert np.array_equal(matmulnbits_reference(packed), sym.numpy())
    assert torch.allclose(sym + offsets.repeat_interleave(m.group_size, 1), m.dequantized(), rtol=0, atol=1e-6)
    x = torch.randn(5, packed.K)
    sums = x.reshape(5, -1, m.group_size).sum(-1)
    got = _run_matmulnbits(packed, x.numpy()) + sums.numpy() @ offsets.numpy().T
    np.testing.assert_allclose(got, m(x).detach().numpy(), rtol=1e-5, atol=1e-4)


def test_matmulnbits_refuses_unsupported_blocks():
    with pytest.raises(UserError, match="power-of-two block size"):
        to_matmulnbits(qlinear(WeightFormat("int", 8, None, True), k=96))
    with pytest.raises(UserError, match="bit weights"):
        to_matmulnbits(qlinear(WeightFormat("int", 3, 32, True)))


# ---- torchao / ExecuTorch ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,act", [(WeightFormat("int", 4, 32, True), True),
                                     (WeightFormat("int", 4, 64, False), False),
                                     (WeightFormat("int", 8, None, True), True)], ids=str)
def test_torchao_tensor_computes_the_same_linear(fmt, act):
    pytest.importorskip("torchao")
    m = qlinear(fmt, act_quant=act)
    t = to_torchao(m)
    assert torch.equal(t.dequantize(), m.dequantized())
    x = torch.randn(2, 3, 256)
    assert torch.equal(F.linear(x, t), m(x))


def test_torchao_offset_linear_computes_a_float_zero_point_linear():
    """8da4w-*-fzp for XNNPACK: the symmetric part as torchao's tensor (zero point 0, int8 dynamic
    activations) plus the float group-offset linear equals the eager module's own split forward."""
    pytest.importorskip("torchao")
    from edgefinfer.compile.quant.layouts import OffsetLinear

    m = qlinear(WeightFormat("int", 4, 32, False, "bfloat16", float_zero=True), act_quant=True)
    model = nn.Sequential(m)
    x = torch.randn(2, 3, 256)
    want = m(x)
    torchao_model(model)
    assert isinstance(model[0], OffsetLinear)
    assert torch.equal(model[0].linear.weight.zero_point, torch.zeros_like(m.zeros, dtype=torch.int8))
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    # Against the plain (q - z) * d linear on quantized activations: only the offsets' activations differ.
    plain = F.linear(x, m.dequantized())
    assert (model(x) - plain).abs().max() < 0.05 * plain.abs().max()


def test_torchao_model_swap_keeps_logits():
    pytest.importorskip("torchao")
    from edgefinfer.compile.quant.apply import quantize_model
    from tests.helpers import tiny_model

    model = tiny_model(tie_word_embeddings=True)
    quantize_model(model, parse_recipe("8da4w-g32-emb4"))
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        before = model(ids)
        torchao_model(model)
        after = model(ids)
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert model.lm_head.weight.activation_quantization is not None
    assert model.model.embed_tokens.weight.qdata.data_ptr() == model.lm_head.weight.qdata.data_ptr()  # one copy
    assert torch.equal(before, after)
