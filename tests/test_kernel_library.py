"""The kernel operators (kernels/library.py): each declared once, with a fake and a CPU implementation that
torch.library's own checks accept, and every kernel set made of exactly those operators.

opcheck runs each operator on small CPU inputs and checks its schema against what the implementation does,
its fake against the real outputs (shapes, dtypes, strides), and that torch.compile's dispatch modes see it
the same way. The CPU implementation is the torch twin, so the numbers are reference.py's.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import HAS_TRITON

from hf_switchback import KernelOptions
from hf_switchback.kernels import backends, library, reference

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _q(m: int, k: int, qdtype: torch.dtype = torch.int8):
    return reference.quantize_rowwise(torch.randn(m, k), qdtype)


def _sample_args(name: str) -> list[tuple]:
    """Small CPU argument tuples per operator: odd shapes, int8 and fp8, with and without the optional parts."""
    torch.manual_seed(0)
    x, w = torch.randn(5, 12, dtype=torch.bfloat16), torch.randn(7, 12)
    zero_row = x.clone()
    zero_row[2] = 0
    (a_q, a_s), (b_q, b_s) = _q(5, 12), _q(7, 12)
    (fa_q, fa_s), (fb_q, fb_s) = _q(5, 16, torch.float8_e4m3fn), _q(8, 16, torch.float8_e4m3fn)
    h, g = torch.randn(5, 7, dtype=torch.bfloat16), torch.randn(5, 7, dtype=torch.bfloat16)
    by_name = {
        # x's dtype out, and the autocast case: float32 x, bfloat16 y; with and without the affine parameters
        "layernorm_quantize_rowwise": [
            (
                x,
                torch.randn(12, dtype=torch.bfloat16),
                torch.randn(12, dtype=torch.bfloat16),
                1e-5,
                torch.int8,
                x.dtype,
            ),
            (zero_row.float(), None, None, 1e-6, torch.float8_e4m3fn, torch.bfloat16),
        ],
        # float32 residual + bfloat16 delta (the encoder layer's add), and one dtype
        "add_layernorm_quantize_rowwise": [
            (x.float(), x, torch.randn(12), torch.randn(12), 1e-5, torch.int8, torch.bfloat16),
            (x, zero_row, None, None, 1e-6, torch.float8_e4m3fn, x.dtype),
        ],
        "quantize_rowwise": [(x, torch.int8), (zero_row, torch.float8_e4m3fn)],
        "quantize_rowwise_colsum": [(x, torch.int8), (w, torch.float8_e5m2)],
        "quantize_tensorwise": [(x, torch.int8), (w, torch.float8_e4m3fn)],
        "quantize_rowwise_transposed": [(w, torch.int8), (x, torch.float8_e4m3fn)],
        "quantize_tensorwise_transposed": [(w, torch.int8)],
        "dequantize_rowwise": [(a_q, a_s, torch.bfloat16), (fa_q, fa_s, torch.float32)],
        # 5 tokens padded to 16, and unpadded; a zero token
        "quantize_over_tokens": [(zero_row, torch.float8_e5m2, 16), (w, torch.int8, 1)],
        "requantize_over_tokens": [
            (a_q, a_s, torch.bfloat16, torch.float8_e4m3fn, 16),
            (fa_q, fa_s, torch.float32, torch.int8, 1),
        ],
        "scaled_matmul": [
            (a_q, b_q, a_s, b_s, torch.randn(7), torch.bfloat16, False, "auto"),
            (fa_q, fb_q, fa_s, fb_s.amax(), None, torch.float32, True, "triton"),
        ],
        "act_quantize_rowwise": [(h, torch.int8, "gelu"), (h.float(), torch.float8_e4m3fn, "quick_gelu")],
        "act_and_quantize_rowwise": [
            (h, torch.int8, "gelu_tanh"),
            (h.float(), torch.float8_e4m3fn, "quick_gelu"),
        ],
        "act_backward_quantize_colsum": [
            (g, h, torch.int8, "gelu", True, "auto"),
            (g, h, torch.float8_e5m2, "gelu_tanh", False, "tiles"),
        ],
        "scaled_matmul_act_backward": [
            (
                a_q,
                b_q,
                a_s,
                b_s,
                torch.randn(5, 7, dtype=torch.bfloat16),
                torch.int8,
                "gelu",
                True,
                False,
                "auto",
                "rows",
            )
        ],
    }
    by_name["scaled_matmul_recompute"] = by_name["scaled_matmul"]
    return by_name[name]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t  # fp8 has no equality kernel on the CPU


def test_every_operator_is_declared_once_with_a_fake_and_a_cpu_implementation():
    ops = backends.declare_operators()
    assert list(ops) == list(library.OP_NAMES) and len(set(library.OP_NAMES)) == len(library.OPS)
    for op in library.OPS:
        packet = getattr(torch.ops.hf_switchback, op.name)
        # the operator's arguments are the twin's (without `options`) followed by the declared option fields
        twin = [p for p in inspect.signature(op.reference).parameters if p != "options"]
        assert [a.name for a in packet.default._schema.arguments] == twin + list(op.options), op.name


@pytest.mark.parametrize("name", library.OP_NAMES)
def test_opcheck_passes_on_cpu(name):
    backends.declare_operators()
    packet = getattr(torch.ops.hf_switchback, name)
    for args in _sample_args(name):
        utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        if any(isinstance(a, torch.Tensor) and a.dtype in _FP8 for a in args):
            # the schema check compares inputs before and after the call with ops the CPU lacks for fp8
            utils = utils[1:]
        torch.library.opcheck(packet.default, args, test_utils=utils)


@pytest.mark.parametrize("name", library.OP_NAMES)
def test_cpu_implementation_is_the_torch_twin(name):
    """On the CPU the operator computes exactly what its twin computes; the fake gives the same metadata."""
    backends.declare_operators()
    op = library.BY_NAME[name]
    for args in _sample_args(name):
        got = getattr(torch.ops.hf_switchback, name)(*args)
        want = op.reference(*args[: len(args) - len(op.options)])
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert torch.equal(_bits(a), _bits(b)), name
        with torch._subclasses.FakeTensorMode() as mode:  # the registered fake, not the CPU implementation
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fakes = getattr(torch.ops.hf_switchback, name)(*fake_args)
        fakes = fakes if isinstance(fakes, tuple) else (fakes,)
        assert [(f.shape, f.dtype) for f in fakes] == [(w.shape, w.dtype) for w in want], name


def _kernel_sets() -> list:
    sets = [library.REFERENCE, backends.get_kernels("torch", torch.device("cpu"), KernelOptions())]
    if HAS_TRITON:
        from hf_switchback.kernels import compiled, ops

        sets += [ops.KERNELS, compiled.KERNELS]
    return sets


def test_every_kernel_set_has_exactly_the_declared_operators():
    for kernel_set in _kernel_sets():
        functions = {n for n, v in vars(kernel_set).items() if callable(v)}
        assert functions == set(library.OP_NAMES), kernel_set
        for op in library.OPS:  # the twin's signature, `options` included
            assert inspect.signature(getattr(kernel_set, op.name)) == inspect.signature(op.reference)


def test_kernel_set_fills_defaults_and_takes_keywords_like_the_twin():
    x = torch.randn(4, 6)
    want = reference.quantize_rowwise(x)
    for got in (
        library.REFERENCE.quantize_rowwise(x),
        library.REFERENCE.quantize_rowwise(x, qdtype=torch.int8, options=KernelOptions()),
    ):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(TypeError, match="missing arguments"):
        library.REFERENCE.scaled_matmul(*want)
    with pytest.raises(TypeError, match="missing a required argument"):
        library.REFERENCE.scaled_matmul(*want, out_dtype=torch.float32)


def test_option_arguments_are_the_kernel_options_fields():
    fields = set(KernelOptions.__dataclass_fields__)
    for op in library.OPS:
        assert set(op.options) <= fields, op.name
    assert library.BY_NAME["scaled_matmul"].options == ("use_tma", "fp8_gemm")


def test_compiled_kernel_set_traces_in_one_graph_on_cpu():
    """The compiled set's policies, the kernel-set functions and the operators trace without graph breaks;
    on the CPU every operator runs its twin, so the compiled result equals the reference set's."""
    pytest.importorskip("triton")
    from hf_switchback.kernels import compiled

    def step(x, w, grad, kernels, options):
        x_q, x_s = kernels.quantize_rowwise(x, torch.int8, options=options)
        w_q, w_s = kernels.quantize_tensorwise(w, torch.int8, options=options)
        out = kernels.scaled_matmul(x_q, w_q, x_s, w_s, None, torch.float32, options=options)
        g_q, g_s, colsum = kernels.quantize_rowwise_colsum(grad, torch.int8, options=options)
        wt_q, wt_s = kernels.quantize_tensorwise_transposed(w, torch.int8, options=options)
        grad_x = kernels.scaled_matmul_recompute(g_q, wt_q, g_s, wt_s, None, torch.float32, options=options)
        act = kernels.act_quantize_rowwise(out, torch.int8, "gelu", options=options)
        back = kernels.scaled_matmul_act_backward(
            g_q, wt_q, g_s, wt_s, x, torch.int8, "gelu", True, options=options
        )
        wgrad_g = kernels.quantize_over_tokens(grad, torch.float8_e5m2, 16, options=options)
        wgrad_x = kernels.requantize_over_tokens(
            x_q, x_s, torch.bfloat16, torch.float8_e4m3fn, 16, options=options
        )
        return out, colsum, grad_x, *act, *back, *wgrad_g, *wgrad_x

    torch.manual_seed(0)
    x, w, grad = torch.randn(6, 16), torch.randn(8, 16), torch.randn(6, 8)
    for options in (
        KernelOptions(),
        KernelOptions(use_tma=True, trace_gemm=False, fuse_quantize_under_compile=False),
    ):
        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(x, w, grad, compiled.KERNELS, options)
        want = step(x, w, grad, library.REFERENCE, options)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(_bits(a), _bits(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("use_tma", [False, True])
def test_eager_triton_set_through_the_operators_equals_the_reference_set(use_tma):
    """With direct_eager off, the eager Triton set's routes send every call through torch.ops.hf_switchback
    (use_tma: the GEMMs through the opaque operator, the fused GEMM + activation backward in two steps); on the
    CPU those run the twins, so each result equals the reference set's bitwise."""
    pytest.importorskip("triton")
    from hf_switchback.kernels import ops

    torch.manual_seed(0)
    x, w, h = torch.randn(6, 16), torch.randn(8, 16), torch.randn(6, 8)
    options = KernelOptions(direct_eager=False, use_tma=use_tma)

    def step(kernels):
        x_q, x_s = kernels.quantize_rowwise(x, torch.int8, options=options)
        w_q, w_s = kernels.quantize_tensorwise(w, torch.float8_e4m3fn, options=options)
        fw_q, fw_s = kernels.quantize_rowwise(w, torch.int8, options=options)
        out = kernels.scaled_matmul(x_q, fw_q, x_s, fw_s, None, torch.float32, options=options)
        back = kernels.scaled_matmul_act_backward(
            x_q, fw_q, x_s, fw_s, h, torch.int8, "gelu", True, options=options
        )
        return out, w_q, w_s, *back

    for got, want in zip(step(ops.KERNELS), step(library.REFERENCE), strict=True):
        assert torch.equal(_bits(got), _bits(want))
