"""Properties of the torch reference quantizers and the 8-bit matmul (the oracle for the Triton kernels)."""

import pytest
import torch

from hf_switchback.kernels import reference as ref

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("shape", [(1, 1), (7, 83), (131, 17), (64, 256)])
def test_rowwise_int8_round_trip_error_is_at_most_half_a_step(shape):
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[0])[:, None]
    q, scale = ref.quantize_rowwise(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (shape[0],)
    err = (ref.dequantize_rowwise(q, scale) - x).abs()
    # round-to-nearest: each element is off by at most half a quantization step of its row (+ fp32 slack)
    assert torch.all(err <= scale[:, None] * 0.5 * (1 + 1e-5) + 1e-30)


def test_rowwise_int8_hits_plus_minus_127_and_handles_negatives():
    x = torch.tensor([[-3.0, 1.5, 0.0, 3.0], [-0.25, -1.0, 0.5, 0.0]])
    q, scale = ref.quantize_rowwise(x)
    assert q[0].tolist() == [-127, 64, 0, 127]  # 63.5 rounds half to even -> 64
    assert q[1].tolist() == [-32, -127, 64, 0]  # -31.75 -> -32, 63.5 -> 64
    torch.testing.assert_close(scale, torch.tensor([3.0 / 127, 1.0 / 127]))


def test_round_half_to_even():
    # absmax 127 -> scale 1 exactly, so x/scale hits the .5 ties directly
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, 127.0]])
    q, _ = ref.quantize_rowwise(x)
    assert q[0].tolist() == [0, 2, 2, 0, -2, 127]


def test_all_zero_rows_give_zeros_never_nan():
    x = torch.zeros(3, 5)
    x[1] = torch.arange(5.0)
    q, scale = ref.quantize_rowwise(x)
    assert scale[0] == 0 and scale[2] == 0
    assert torch.all(q[0] == 0) and torch.all(q[2] == 0)
    assert torch.isfinite(ref.dequantize_rowwise(q, scale)).all()
    qt, st = ref.quantize_tensorwise(torch.zeros(4, 4))
    assert st == 0 and torch.all(qt == 0)


def test_tensorwise_uses_one_scale():
    x = torch.randn(9, 13)
    q, scale = ref.quantize_tensorwise(x)
    assert scale.shape == () and scale == x.abs().max() / 127
    assert q.abs().max() == 127
    assert (ref.dequantize_tensorwise(q, scale) - x).abs().max() <= scale * 0.5 * (1 + 1e-5)


def test_transposed_quantizers_are_the_transposes():
    w = torch.randn(24, 40)
    q, s = ref.quantize_rowwise_transposed(w)
    assert q.shape == (40, 24) and s.shape == (40,)
    torch.testing.assert_close(s, w.abs().amax(dim=0) / 127)
    qt, st = ref.quantize_tensorwise_transposed(w)
    q0, s0 = ref.quantize_tensorwise(w)
    assert torch.equal(qt, q0.t()) and st == s0


@pytest.mark.parametrize("qdtype", FP8)
def test_fp8_quantize_saturates_at_format_max_and_round_trips(qdtype):
    x = torch.randn(16, 33) * 10
    q, scale = ref.quantize_rowwise(x, qdtype)
    assert q.dtype == qdtype
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((16,), ref.QMAX[qdtype]))
    rel = (ref.dequantize_rowwise(q, scale) - x).abs() / x.abs().amax(dim=1, keepdim=True)
    bits = 3 if qdtype == torch.float8_e4m3fn else 2
    assert rel.max() <= 2.0 ** -(bits + 1) * (1 + 1e-3)  # half an ulp at the top binade


def test_int8_matmul_accumulates_exactly_in_int32():
    a = torch.randint(-127, 128, (37, 300), dtype=torch.int8)
    b = torch.randint(-127, 128, (29, 300), dtype=torch.int8)
    exact = a.long() @ b.long().t()
    assert torch.equal(ref.int8_matmul_int32(a, b).long(), exact)
    # worst case magnitude: 127*127*K must not overflow or lose bits
    big = torch.full((2, 4096), 127, dtype=torch.int8)
    assert ref.int8_matmul_int32(big, big)[0, 0].item() == 127 * 127 * 4096


@pytest.mark.parametrize("b_rowwise", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_matmul_dequantizes_and_adds_bias(b_rowwise, out_dtype):
    x, w, bias = torch.randn(11, 64), torch.randn(21, 64), torch.randn(21)
    xq, xs = ref.quantize_rowwise(x)
    wq, ws = ref.quantize_rowwise(w) if b_rowwise else ref.quantize_tensorwise(w)
    out = ref.scaled_matmul(xq, wq, xs, ws, bias, out_dtype)
    assert out.dtype == out_dtype and out.shape == (11, 21)
    w_deq = ref.dequantize_rowwise(wq, ws) if b_rowwise else ref.dequantize_tensorwise(wq, ws)
    expected = ref.dequantize_rowwise(xq, xs).double() @ w_deq.double().t() + bias.double()
    torch.testing.assert_close(out.double(), expected.to(out_dtype).double(), rtol=1e-2, atol=1e-2)
    if out_dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_scaled_matmul_rejects_mixed_operand_dtypes():
    a = torch.zeros(2, 4, dtype=torch.int8)
    b = torch.zeros(2, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="share a dtype"):
        ref.scaled_matmul(a, b, torch.ones(2), torch.ones(()), None, torch.float32)


def test_unsupported_qdtype_is_rejected():
    with pytest.raises(ValueError, match="unsupported quantized dtype"):
        ref.quantize_rowwise(torch.ones(2, 2), torch.uint8)


@pytest.mark.parametrize("qdtype", [torch.int8, *FP8])
@pytest.mark.parametrize("shape", [(0, 5), (1, 1), (7, 83), (131, 17)])
def test_quantize_rowwise_colsum_is_quantize_plus_bias_grad(shape, qdtype):
    x = (torch.randn(shape) * 3).bfloat16()
    q, scale, colsum = ref.quantize_rowwise_colsum(x, qdtype)
    q_ref, s_ref = ref.quantize_rowwise(x, qdtype)
    assert torch.equal(q.view(torch.int8), q_ref.view(torch.int8)) and torch.equal(scale, s_ref)
    assert colsum.dtype == torch.float32 and colsum.shape == (shape[1],)
    assert torch.equal(colsum, x.sum(dim=0, dtype=torch.float32))
