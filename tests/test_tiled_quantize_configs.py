"""kernels/tiled_quantize_configs.py: Inductor's transposed 8-bit writes generated with one tile config.

The CPU tests run Inductor's own Triton code generation (its Triton backend for CPU tensors: the same kernel
code as for CUDA, which no CPU driver here runs) on graphs with a transposed write: the kernel source Inductor
hands to `async_compile.triton` is recorded instead of compiled, and its decorator is evaluated with torch's
`triton_heuristics.pointwise`, which returns the configs a compile worker would compile. A transposed 8-bit write
(our weight quantize's twin among them) gets one config with the function installed and torch's six without; a
16-bit transposed write keeps six either way. The GPU test compiles a SwitchBack layer and checks the same of
every kernel the compile workers built.
"""

import contextlib
import re
import types
import warnings

import pytest
import torch

from hf_switchback.kernels import reference, tiled_quantize_configs

triton_codegen = pytest.importorskip("torch._inductor.codegen.triton")
async_compile_module = pytest.importorskip("torch._inductor.async_compile")
triton = pytest.importorskip("triton")
TritonKernel = triton_codegen.TritonKernel


@pytest.fixture
def restored():
    """Leave the function installed or not as the test found it."""
    was = tiled_quantize_configs.is_installed()
    tiled_quantize_configs.uninstall()
    yield
    tiled_quantize_configs.uninstall()
    if was:
        tiled_quantize_configs.install()


def _generated_kernels(fn, *args, monkeypatch) -> dict[str, str]:
    """{kernel name: source} of the Triton kernels Inductor generates for fn(*args) on the CPU."""
    import torch._inductor.config as inductor_config
    import torch.utils._triton as torch_triton

    pytest.importorskip("triton")
    sources = {}

    def record(self, name, source, *rest, **kwargs):
        sources[name] = source  # nothing to launch: the compiled call below fails, the text is what we test

    monkeypatch.setattr(async_compile_module.AsyncCompile, "triton", record)
    # its hash names the active Triton driver, which a machine without a GPU (or Triton's CPU backend) lacks
    monkeypatch.setattr(torch_triton, "triton_hash_with_backend", lambda: "cpu-test")
    torch._dynamo.reset()
    with (
        inductor_config.patch(cpu_backend="triton", compile_threads=1, force_disable_caches=True),
        contextlib.suppress(
            Exception
        ),  # the recorded kernels cannot run: the call fails once they are generated
    ):
        torch.compile(fn)(*args)
    torch._dynamo.reset()
    assert sources, "Inductor generated no Triton kernel"
    return sources


def _configs(source: str, tmp_path) -> int:
    """How many configs torch's pointwise heuristic gives the kernel module `source` (what a worker compiles)."""
    from torch._inductor.runtime import triton_heuristics

    counts = []
    pointwise = triton_heuristics.pointwise

    def counting(*args, **kwargs):
        counts.append(len(pointwise(*args, **kwargs, return_configs=True)))
        return lambda fn: fn

    path = tmp_path / f"kernel_{abs(hash(source))}.py"  # @triton.jit reads its source from a file
    path.write_text(source)
    module = types.ModuleType(path.stem)
    module.__file__ = str(path)
    triton_heuristics.pointwise = counting
    try:
        with warnings.catch_warnings():  # "no active CPU backend": these kernels are only generated here
            warnings.simplefilter("ignore", UserWarning)
            exec(compile(source, str(path), "exec"), module.__dict__)  # a module Inductor wrote
    finally:
        triton_heuristics.pointwise = pointwise
    assert len(counts) == 1, source
    return counts[0]


def _transposed_fp8(w, scale):
    return (w.t() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).contiguous()


def _transposed_bf16(w, scale):
    return (w.t() * scale).to(torch.bfloat16).contiguous()


def _meta(source: str) -> list[str]:
    return re.findall(r"'autotune_pointwise': (\w+)", source)


def test_a_transposed_8bit_write_gets_one_config_and_a_16bit_one_keeps_torchs(
    restored, monkeypatch, tmp_path
):
    w, scale = torch.randn(96, 320), torch.tensor(0.25)
    assert tiled_quantize_configs.install()
    other_library = _generated_kernels(_transposed_fp8, w, scale, monkeypatch=monkeypatch)
    # (the graphs below as SwitchBack graphs: on the CPU our ops run their torch twins, not our kernels)
    monkeypatch.setattr(tiled_quantize_configs, "launches_our_kernels", lambda graph: True)
    fp8 = _generated_kernels(_transposed_fp8, w, scale, monkeypatch=monkeypatch)
    bf16 = _generated_kernels(_transposed_bf16, w, scale, monkeypatch=monkeypatch)
    assert tiled_quantize_configs.stats["one_config"] == 1
    tiled_quantize_configs.uninstall()
    fp8_torch = _generated_kernels(_transposed_fp8, w, scale, monkeypatch=monkeypatch)

    assert [_configs(s, tmp_path) for s in fp8.values()] == [1]
    assert [_meta(s) for s in fp8.values()] == [["False"]]
    # without the function, in a graph without our kernels, and for a 16-bit write: torch's six tile shapes
    assert [_configs(s, tmp_path) for s in fp8_torch.values()] == [6]
    assert [_configs(s, tmp_path) for s in other_library.values()] == [6]
    assert [_configs(s, tmp_path) for s in bf16.values()] == [6]
    assert [_meta(s) for s in bf16.values()] == [["True"]]
    assert tiled_quantize_configs.stats["one_config"] == 0  # (uninstall zeroes it)


def test_our_weight_quantize_for_the_grad_input_gemm_gets_one_config(restored, monkeypatch, tmp_path):
    """The twin the compiled kernel set uses for the transposed weight operand: its 2-D kernel has one config,
    its absmax reduction is generated as before."""
    assert tiled_quantize_configs.install()
    monkeypatch.setattr(tiled_quantize_configs, "launches_our_kernels", lambda graph: True)  # (as above)
    w = torch.randn(192, 64)
    kernels = _generated_kernels(
        lambda w: reference.quantize_tensorwise_transposed(w, torch.float8_e4m3fn), w, monkeypatch=monkeypatch
    )
    tiled = {name: s for name, s in kernels.items() if "tile_hint=" in s}
    assert len(tiled) == 1 and [_configs(s, tmp_path) for s in tiled.values()] == [1], list(kernels)
    assert all(_meta(s) == ["True"] for name, s in kernels.items() if name not in tiled)


@torch.library.triton_op("hf_switchback_test::normalized_rows", mutates_args=())
def normalized_rows(x: torch.Tensor) -> torch.Tensor:
    """Our LayerNorm + quantize kernel launched as the compiled kernel set launches it: the 8-bit rows."""
    from hf_switchback.kernels import norm_quant

    wrap = torch.library.wrap_triton
    return norm_quant.layernorm_quantize_rowwise(x, None, None, 1e-5, torch.int8, torch.float32, wrap=wrap)[0]


def _switchback_like(w, scale, x):
    return _transposed_fp8(w, scale), normalized_rows(x)


def test_in_a_graph_that_launches_our_kernel_the_tiled_8bit_write_gets_one_config(
    restored, monkeypatch, tmp_path
):
    """No stand-in: the graph calls one of our Triton kernels, which the function finds in Inductor's graph."""
    from hf_switchback.kernels import kernel_access

    was_declared = kernel_access.is_installed()
    assert (
        kernel_access.install() and tiled_quantize_configs.install()
    )  # (declared writes: no GPU to analyze on)
    try:
        kernels = _generated_kernels(
            _switchback_like,
            torch.randn(96, 320),
            torch.tensor(0.25),
            torch.randn(8, 64),
            monkeypatch=monkeypatch,
        )
    finally:
        if not was_declared:
            kernel_access.uninstall()
    tiled = [s for s in kernels.values() if "tile_hint=" in s]
    assert "_layernorm_quantize_kernel" in kernels and [_configs(s, tmp_path) for s in tiled] == [1], list(
        kernels
    )


class _Lowering:
    """What launches_our_kernels reads of Inductor's GraphLowering: its FX graph."""

    def __init__(self, graph):
        self.graph = graph


def test_a_graph_launches_our_kernels_when_a_call_is_to_a_kernel_of_this_package():
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from hf_switchback.kernels import norm_quant

    @triton.jit
    def _not_ours(x_ptr):
        pass

    def lowering(kernel) -> _Lowering:
        graph = torch.fx.Graph()
        kwargs = dict(kernel_idx=kernel_side_table.add_kernel(kernel), constant_args_idx=0, grid=[(1, 1, 1)])
        mutation = torch.ops.higher_order.triton_kernel_wrapper_mutation
        graph.call_function(mutation, kwargs={**kwargs, "tma_descriptor_metadata": {}, "kwargs": {}})
        return _Lowering(graph)

    assert tiled_quantize_configs.launches_our_kernels(lowering(norm_quant._layernorm_quantize_kernel))
    assert not tiled_quantize_configs.launches_our_kernels(lowering(_not_ours))
    assert not tiled_quantize_configs.launches_our_kernels(_Lowering(torch.fx.Graph()))


def test_what_cannot_be_read_is_generated_as_torch_would():
    assert not tiled_quantize_configs.is_tiled_8bit_write(object())
    assert not tiled_quantize_configs.is_tiled_8bit_write(types.SimpleNamespace(inside_reduction=True))
    one_dim = types.SimpleNamespace(inside_reduction=False, numels={"x": 8, "r0_": 1})
    assert not tiled_quantize_configs.is_tiled_8bit_write(one_dim)


def test_the_switch_leaves_torchs_function_alone(restored, monkeypatch):
    original = TritonKernel.codegen_kernel
    monkeypatch.setenv("HF_SWITCHBACK_TUNE_TILED_QUANTIZE", "1")
    assert not tiled_quantize_configs.install()
    assert TritonKernel.codegen_kernel is original and not tiled_quantize_configs.is_installed()


def test_install_once_and_uninstall_restores_torchs_function(restored):
    original = TritonKernel.codegen_kernel
    assert tiled_quantize_configs.install() and tiled_quantize_configs.install()
    assert TritonKernel.codegen_kernel.hf_switchback_original is original  # one function in front, not two
    tiled_quantize_configs.uninstall()
    assert TritonKernel.codegen_kernel is original


def test_inert_under_another_wrapper(restored, monkeypatch, tmp_path):
    """Where another function was put in front of ours, uninstall leaves both and ours passes calls on."""
    assert tiled_quantize_configs.install()
    ours = TritonKernel.codegen_kernel

    def theirs(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    monkeypatch.setattr(TritonKernel, "codegen_kernel", theirs)
    tiled_quantize_configs.uninstall()
    assert TritonKernel.codegen_kernel is theirs
    fp8 = _generated_kernels(
        _transposed_fp8, torch.randn(96, 320), torch.tensor(0.25), monkeypatch=monkeypatch
    )
    assert [_configs(s, tmp_path) for s in fp8.values()] == [6]


@pytest.mark.gpu
def test_gpu_a_compiled_layer_compiles_one_config_of_each_8bit_tiled_kernel(restored, monkeypatch):
    """Every kernel the compile of a SwitchBack layer generates with two tiled dimensions and an 8-bit output has
    one config; the layer computes what it computes with torch's six."""
    from test_ttir_cache import compiled_step, small_layer_and_input

    layer, x = small_layer_and_input()
    monkeypatch.setenv("HF_SWITCHBACK_TUNE_TILED_QUANTIZE", "1")  # (the first trace would install it)
    tuned = compiled_step(layer, x)
    monkeypatch.delenv("HF_SWITCHBACK_TUNE_TILED_QUANTIZE")
    assert tiled_quantize_configs.install()
    sources = []
    original = async_compile_module.AsyncCompile.triton

    def recording(self, name, source, *args, **kwargs):
        sources.append(source)
        return original(self, name, source, *args, **kwargs)

    monkeypatch.setattr(async_compile_module.AsyncCompile, "triton", recording)
    one = compiled_step(layer, x)
    eight_bit_tiled = [
        s for s in sources if "tile_hint=TileHint.DEFAULT" in s and re.search(r"'out_ptr\d+': '\*(i8|fp8)", s)
    ]
    assert eight_bit_tiled and all(_meta(s) == ["False"] for s in eight_bit_tiled)
    assert tiled_quantize_configs.stats["one_config"] >= len({s for s in eight_bit_tiled})
    for got, want in zip(one, tuned, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)
