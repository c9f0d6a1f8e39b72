"""SwitchBack layer numerics on the torch path: every variant x dtype x odd shape, against a float64 oracle.

Signal-to-noise ratio, SNR = 10 log10(|ref|² / |ref - ours|²) in dB, over the whole tensor. Thresholds were
measured on CPU over 3 seeds and the shapes below (worst case in brackets) and set a few dB under:
- int8 output and grad-input: >= 38 dB   [measured 40.9 - 42.7]   (int8 absmax: ~42 dB on Gaussian data)
- fp8 e4m3 output / grad-input: >= 25 dB [27.8 - 28.3]; e5m2 grad-input: >= 19 dB [22.2]
- grad-weight of the non-memory-efficient variants is the 16-bit matmul itself: within 3 dB of nn.Linear's
  own dW in that dtype (fp32 ~142, fp16 ~73, bf16 ~55 dB)
- memory-efficient grad-weight (from int8 X): >= 40 dB [43.7 - 44.0]
"""

import math

import pytest
import torch
from helpers import KernelSpy, snr_db
from torch import nn

from hf_switchback import KernelOptions, SwitchBackConfig, SwitchBackLinear, functional, switchback_linear

VARIANTS = {
    "int8/tensor": SwitchBackConfig(backend="torch"),
    "int8/row": SwitchBackConfig(weight_scaling="row", backend="torch"),
    "int8/tensor/mem": SwitchBackConfig(memory_efficient=True, backend="torch"),
    "int8/row/mem": SwitchBackConfig(weight_scaling="row", memory_efficient=True, backend="torch"),
    "fp8/tensor": SwitchBackConfig(precision="fp8", backend="torch"),
    "fp8/row/e5m2": SwitchBackConfig(
        precision="fp8", weight_scaling="row", fp8_grad_format="e5m2", backend="torch"
    ),
    "int8/tensor/fp8-grad": SwitchBackConfig(grad_precision="fp8", backend="torch"),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (input shape, in_features, out_features): odd sizes, 2-D and 3-D, a single token
SHAPES = [((5, 83), 83, 131), ((2, 9, 64), 64, 256), ((3, 1, 131), 131, 83)]


def thresholds(cfg: SwitchBackConfig, dtype: torch.dtype) -> dict:
    out = 25.0 if cfg.precision == "fp8" else 38.0
    fp8_grad = functional.grad_precision(cfg, torch.device("cpu")) == "fp8"
    dx = (19.0 if cfg.fp8_grad_format == "e5m2" else 25.0) if fp8_grad else 38.0
    return {"out": out, "dx": dx, "dw_mem": 40.0}


def make_pair(cfg, in_f, out_f, dtype, bias=True):
    plain = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    twin = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    twin.load_state_dict(plain.state_dict())
    return plain, SwitchBackLinear.from_linear(twin, cfg)


@pytest.mark.parametrize("shape,in_f,out_f", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_output_and_all_gradients_match_float64_oracle(name, dtype, shape, in_f, out_f):
    cfg = VARIANTS[name]
    plain, sb = make_pair(cfg, in_f, out_f, dtype)
    x = torch.randn(*shape, dtype=dtype)
    x_plain, x_sb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_plain, y_sb = plain(x_plain), sb(x_sb)
    assert y_sb.dtype == dtype and y_sb.shape == (*shape[:-1], out_f)
    g = torch.randn_like(y_plain)
    y_plain.backward(g)
    y_sb.backward(g)

    xd, wd, gd = x.double().reshape(-1, in_f), plain.weight.double(), g.double().reshape(-1, out_f)
    y_ref = (xd @ wd.t() + plain.bias.double()).reshape(y_sb.shape)
    dw_ref, db_ref, dx_ref = gd.t() @ xd, gd.sum(0), (gd @ wd).reshape(x.shape)
    t = thresholds(cfg, dtype)

    assert snr_db(y_ref, y_sb) >= t["out"]
    assert snr_db(dx_ref, x_sb.grad) >= t["dx"]
    assert sb.weight.grad.dtype == dtype and sb.bias.grad.dtype == dtype
    if cfg.memory_efficient:
        assert snr_db(dw_ref, sb.weight.grad) >= t["dw_mem"]
    else:  # the 16-bit matmul: as accurate as nn.Linear's own grad-weight in this dtype
        assert snr_db(dw_ref, sb.weight.grad) >= snr_db(dw_ref, plain.weight.grad) - 3
    assert snr_db(db_ref, sb.bias.grad) >= snr_db(db_ref, plain.bias.grad) - 3


@pytest.mark.parametrize("name", ["int8/tensor", "int8/row/mem"])
def test_no_bias_and_input_without_grad(name):
    _, sb = make_pair(VARIANTS[name], 40, 24, torch.float32, bias=False)
    x = torch.randn(6, 40)
    y = sb(x)
    y.sum().backward()
    assert sb.bias is None and sb.weight.grad is not None and torch.isfinite(sb.weight.grad).all()


def test_autocast_output_is_the_autocast_dtype_like_nn_linear():
    plain, sb = make_pair(VARIANTS["int8/tensor"], 32, 48, torch.float32)
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_plain, y_sb = plain(x), sb(x)
    assert y_sb.dtype == y_plain.dtype == torch.bfloat16
    y_sb.float().sum().backward()
    assert x.grad.dtype == torch.float32 and sb.weight.grad.dtype == torch.float32
    assert snr_db(y_plain.float(), y_sb.float()) > 30


def test_memory_efficient_saves_int8_input_not_16bit():
    def saved_bytes(cfg):
        sb = SwitchBackLinear(256, 256, config=cfg).to(torch.bfloat16)
        x = torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)
        packed = []

        def pack(t):
            if not isinstance(t, nn.Parameter):  # the weight is shared, not an activation
                packed.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            sb(x)
        return sum(packed)

    full = saved_bytes(VARIANTS["int8/tensor"])
    mem = saved_bytes(VARIANTS["int8/tensor/mem"])
    assert full == 512 * 256 * 2
    assert mem == 512 * 256 * 1 + 512 * 4  # int8 X + one float32 scale per row


def test_linears_sharing_an_input_quantize_it_once_and_save_one_8bit_copy(monkeypatch):
    """q, k and v of an attention layer get the same tensor: one quantize pass, one int8 copy saved; the
    results equal three independent calls; an in-place change of the input between calls is seen."""
    cfg = VARIANTS["int8/tensor/mem"]
    layers = [SwitchBackLinear(64, 64, config=cfg) for _ in range(3)]
    x = torch.randn(40, 64, requires_grad=True)
    storages = {}

    def pack(t):
        if not isinstance(t, nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = (t.dtype, t.untyped_storage().nbytes())
        return t

    spy = KernelSpy.install(monkeypatch)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = [layer(x) for layer in layers]
    int8_saved = [nbytes for dtype, nbytes in storages.values() if dtype == torch.int8]
    assert int8_saved == [40 * 64], storages
    assert spy.names().count("quantize_rowwise") == 1, spy.names()
    sum(o.sum() for o in outs).backward()
    shared_grad = x.grad.clone()
    # each layer alone (a fresh input object each time: nothing to share)
    x.grad = None
    for layer, out in zip(layers, outs, strict=True):
        alone = layer(x.detach().clone().requires_grad_(True))
        assert torch.equal(alone, out)
    separate = torch.zeros_like(x)
    for layer in layers:
        xi = x.detach().clone().requires_grad_(True)
        layer(xi).sum().backward()
        separate += xi.grad
    torch.testing.assert_close(shared_grad, separate)
    # an in-place change between two calls on the same tensor is quantized again
    y = torch.randn(40, 64)
    layers[0](y)
    y.mul_(2)
    assert torch.equal(layers[0](y), layers[0](y.clone()))


def test_wrong_feature_size_gives_nn_linear_error():
    plain, sb = make_pair(VARIANTS["int8/tensor"], 16, 8, torch.float32)
    x = torch.randn(3, 15)
    with pytest.raises(RuntimeError) as plain_err:
        plain(x)
    with pytest.raises(RuntimeError) as sb_err:
        sb(x)
    assert str(sb_err.value) == str(plain_err.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool])
def test_integer_and_bool_inputs_are_a_type_error(dtype):
    sb = SwitchBackLinear(4, 4, config=VARIANTS["int8/tensor"])
    with pytest.raises(TypeError, match="floating-point input"):
        sb(torch.ones(2, 4, dtype=dtype))


@pytest.mark.parametrize("compiled", [False, True])
def test_a_config_of_another_type_is_a_type_error_naming_the_op(compiled):
    # checked before the op's graph leaf: under torch.compile too the error names the op, not Dynamo's graph
    op = torch.compile(switchback_linear, backend="eager") if compiled else switchback_linear
    with pytest.raises(TypeError, match="switchback_linear: config must be a SwitchBackConfig, got dict"):
        op(torch.randn(2, 4), torch.randn(3, 4), None, {"precision": "int8"})
    torch._dynamo.reset()


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_value_only_affects_its_own_row(bad):
    sb = SwitchBackLinear(32, 16, config=VARIANTS["int8/row"])
    x = torch.randn(5, 32)
    clean = sb(x).detach()
    x[2, 7] = bad
    out = sb(x).detach()
    assert not torch.isfinite(out[2]).all()
    rows = [0, 1, 3, 4]
    torch.testing.assert_close(out[rows], clean[rows], rtol=0, atol=0)


def test_min_tokens_falls_back_to_exact_16bit_matmul():
    cfg = SwitchBackConfig(backend="torch", min_tokens=8)
    plain, sb = make_pair(cfg, 24, 12, torch.float32)
    x = torch.randn(7, 24)
    torch.testing.assert_close(sb(x), plain(x), rtol=0, atol=0)  # 7 tokens < 8: exact
    x = torch.randn(8, 24)
    assert not torch.equal(sb(x), plain(x))  # 8 tokens: quantized


def test_empty_batch_and_non_contiguous_input():
    plain, sb = make_pair(VARIANTS["int8/tensor"], 20, 10, torch.float32)
    assert sb(torch.randn(0, 20)).shape == (0, 10)
    x = torch.randn(20, 6).t()  # (6, 20), non-contiguous
    assert not x.is_contiguous()
    assert snr_db(plain(x), sb(x)) > 38


def test_functional_form_matches_module():
    cfg = VARIANTS["int8/row"]
    _, sb = make_pair(cfg, 30, 20, torch.float32)
    x = torch.randn(4, 30)
    torch.testing.assert_close(switchback_linear(x, sb.weight, sb.bias, cfg), sb(x), rtol=0, atol=0)


def test_torch_compile_traces_the_layer_without_graph_breaks():
    import torch._dynamo as dynamo

    sb = SwitchBackLinear(64, 128, config=VARIANTS["int8/row/mem"])
    x = torch.randn(32, 64, requires_grad=True)
    explanation = dynamo.explain(sb)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_automatic_token_floor_only_applies_to_cuda_under_auto(monkeypatch):
    from hf_switchback.functional import AUTO_MIN_TOKENS_CUDA, token_floor
    from hf_switchback.kernels import crossover

    # A CUDA device of a capability with no crossover table (per-shape tables: tests/test_crossover.py).
    monkeypatch.setattr(crossover, "cuda_capability", lambda kind, index: (0, 0) if kind == "cuda" else None)
    assert token_floor(SwitchBackConfig(), "cuda") == AUTO_MIN_TOKENS_CUDA
    assert token_floor(SwitchBackConfig(), "cuda", (768, 3072)) == AUTO_MIN_TOKENS_CUDA
    assert token_floor(SwitchBackConfig(), "cpu") == 0
    assert token_floor(SwitchBackConfig(backend="triton"), "cuda") == 0
    assert token_floor(SwitchBackConfig(min_tokens=0), "cuda") == 0  # explicit: always quantize
    assert token_floor(SwitchBackConfig(min_tokens=5, backend="torch"), "cpu") == 5


@pytest.mark.parametrize("name", ["int8/tensor", "int8/row/mem", "fp8/row/e5m2"])
def test_fused_bias_grad_option_picks_the_one_pass_quantize(name, monkeypatch):
    """KernelOptions.fused_bias_grad: backward takes the bias gradient from the output-gradient quantize pass
    (quantize_rowwise_colsum) or quantizes with quantize_rowwise and sums apart. Same gradients either way."""
    spy = KernelSpy.install(monkeypatch)
    x = torch.randn(3, 7, 40, dtype=torch.bfloat16)
    grad = torch.randn(3, 7, 24, dtype=torch.bfloat16)
    grads, backward_calls = {}, {}
    for fused in (True, False):
        cfg = VARIANTS[name].replace(kernel_options=KernelOptions(fused_bias_grad=fused))
        torch.manual_seed(0)
        _, sb = make_pair(cfg, 40, 24, torch.bfloat16)
        xi = x.clone().requires_grad_(True)
        out = sb(xi)
        spy.calls.clear()
        out.backward(grad)
        backward_calls[fused] = spy.names()
        grads[fused] = (xi.grad, sb.weight.grad, sb.bias.grad)
    assert backward_calls[True].count("quantize_rowwise_colsum") == 1
    assert "quantize_rowwise" not in backward_calls[True]
    assert backward_calls[False].count("quantize_rowwise") == 1
    assert "quantize_rowwise_colsum" not in backward_calls[False]
    for a, b in zip(grads[True], grads[False], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(grads[True][2], grad.reshape(-1, 24).sum(0, dtype=torch.float32).bfloat16())


def test_fp8_gradients_keep_the_small_entries_that_int8_rounds_to_zero():
    """Why grad_precision="fp8" exists: one large entry per gradient row sets the row's absmax scale, and
    row-wise int8 rounds every entry below scale/2 = absmax/254 to zero; e4m3 keeps them (relative rounding).
    The forward (int8) is the same either way."""
    n = 64
    layer = nn.Linear(n, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(n))  # dX = G: the gradient operand's quantization error shows directly
    g = torch.ones(4, n)
    g[:, 0] = 1000.0  # 1/1000 of the absmax: below int8's half step (1/254), well inside e4m3's range
    x = torch.randn(4, n)
    grads, outputs = {}, {}
    for grad_precision in ("int8", "fp8"):
        cfg = SwitchBackConfig(grad_precision=grad_precision, backend="torch")
        sb = SwitchBackLinear.from_linear(nn.Linear(n, n, bias=False), cfg)
        sb.load_state_dict(layer.state_dict())
        xi = x.clone().requires_grad_()
        outputs[grad_precision] = sb(xi)
        outputs[grad_precision].backward(g)
        grads[grad_precision] = xi.grad
    assert torch.equal(outputs["int8"], outputs["fp8"])
    assert torch.all(grads["int8"][:, 1:] == 0)  # every small entry lost
    torch.testing.assert_close(grads["fp8"][:, 1:], g[:, 1:], rtol=0.07, atol=0)  # e4m3: 3 mantissa bits
    assert SwitchBackConfig(grad_precision="fp8").variant == "int8/tensor/fp8-grad"


def test_grad_precision_auto_picks_fp8_only_on_gpus_with_fp8_tensor_cores(monkeypatch):
    int8, e4m3, e5m2 = torch.int8, torch.float8_e4m3fn, torch.float8_e5m2
    auto = SwitchBackConfig()
    assert auto.grad_precision == "auto"
    assert functional.quantized_dtypes(auto, torch.device("cpu")) == (int8, int8)
    assert functional.quantized_dtypes(auto) == (int8, int8)  # device unknown: int8
    cuda0 = torch.device("cuda", 0)
    for capable, grad in ((True, e4m3), (False, int8)):  # Hopper / Ada vs Ampere, without a GPU here
        monkeypatch.setattr(functional, "has_fp8_tensor_cores", lambda index, capable=capable: capable)
        assert functional.quantized_dtypes(auto, cuda0) == (int8, grad)
        assert functional.quantized_dtypes(auto.replace(grad_precision="int8"), cuda0) == (int8, int8)
        e5m2_cfg = auto.replace(precision="fp8", fp8_grad_format="e5m2")
        assert functional.quantized_dtypes(e5m2_cfg, torch.device("cpu")) == (e4m3, e5m2)
    # which GPU is asked: the tensor's own, and for a bare "cuda" the current one (a DDP rank's), not GPU 0
    asked = []
    monkeypatch.setattr(functional, "has_fp8_tensor_cores", lambda index: asked.append(index) or True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    functional.grad_precision(auto, torch.device("cuda", 2))
    functional.grad_precision(auto, torch.device("cuda"))
    assert asked == [2, 3]
    with pytest.raises(ValueError, match="grad_precision='auto'"):
        SwitchBackConfig(precision="fp8", grad_precision="int8")
