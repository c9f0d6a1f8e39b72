"""kernels/kernel_access.py: what our Triton kernels read and write, declared, against torch's own analysis.

torch's analysis (generate the kernel's TTIR, walk it from the stores back to the parameters) needs only
Triton's front end and a target, not a GPU: the CPU tests here name an sm90 target to Triton, record every
kernel launch our traceable operators make (with the `wrap` torch.compile would pass) for a spread of arguments
and flags, and check that each declaration answers what torch's function answers for that launch. The GPU test
compiles a SwitchBack layer and checks that torch generated no TTIR for our kernels and computed the same.
"""

import sys

import pytest
import torch

from hf_switchback.kernels import kernel_access, library, ttir_cache

triton_kernel_wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
ops = pytest.importorskip("hf_switchback.kernels.ops")  # imports triton
from hf_switchback.kernels import matmul, quantize  # noqa: E402  (after the skip: they import triton)

_LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}  # torch moves these into a config


class _Sm90:
    """Triton's active driver, as far as torch's analysis asks it: the target to generate TTIR for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


@pytest.fixture
def sm90_target(monkeypatch):
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton without its CUDA backend")
    import triton.runtime.driver  # noqa: F401  (the module; its `driver` attribute is the setting)

    setting = sys.modules["triton.runtime.driver"].driver
    # where the active driver is stored (private; monkeypatch restores it, even where none was made yet)
    monkeypatch.setattr(setting, "_active" if "_active" in vars(setting) else "active", _Sm90())


@pytest.fixture
def launches(monkeypatch):
    # the GEMM launch asks the GPU for its capability and measured tile: an H100 without a table entry
    monkeypatch.setattr(matmul, "_capability", lambda device_index: (9, 0))
    monkeypatch.setattr(matmul, "_tile_for", lambda *args: None)
    return _launches()


def _launches() -> list[tuple[object, dict]]:
    """(kernel, keyword arguments as torch.compile records them) of every launch of our traceable operators
    over a spread of shapes, dtypes and flags, run on CPU tensors with a `wrap` that records."""
    recorded = []

    def wrap(kernel):
        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    named = dict(zip(kernel.arg_names, args, strict=False))  # trailing defaults left out
                    named.update({k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS})
                    recorded.append((kernel, named))

                return launch

        return Launcher()

    def x(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape).to(dtype)

    class Called(dict):  # ops.CUDA, noting which operators the launches below went through
        def __getitem__(self, name):
            called.add(name)
            return ops.CUDA[name]

    called = set()
    cuda = Called()
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        for width in (96, 8200):  # one pass / past the one-pass limit
            cuda["quantize_rowwise"](x(64, width), qdtype, wrap=wrap)
        cuda["quantize_rowwise_colsum"](x(64, 96), qdtype, wrap=wrap)
        for weight in (None, x(96)):
            cuda["layernorm_quantize_rowwise"](
                x(64, 96), weight, x(96), 1e-5, qdtype, torch.bfloat16, wrap=wrap
            )
        cuda["add_layernorm_quantize_rowwise"](
            x(64, 96), x(64, 96), x(96), None, 1e-5, qdtype, torch.float32, wrap=wrap
        )
        cuda["quantize_over_tokens"](x(64, 96), qdtype, wrap=wrap)
        q = torch.zeros(64, 96, dtype=qdtype)
        cuda["requantize_over_tokens"](q, torch.ones(64), torch.bfloat16, qdtype, wrap=wrap)
        for m, bias, b_scale in (
            (64, None, torch.ones(32)),
            (64, x(32), torch.ones(())),
            (2048, x(32), torch.ones(32)),
        ):
            a_q, b_q = torch.zeros(m, 96, dtype=qdtype), torch.zeros(32, 96, dtype=qdtype)
            cuda["scaled_matmul"](
                a_q, b_q, torch.ones(m), b_scale, bias, torch.bfloat16, False, "triton", wrap=wrap
            )
        for activation in ("gelu", "quick_gelu"):
            cuda["act_quantize_rowwise"](x(64, 96), qdtype, activation, wrap=wrap)
            cuda["act_and_quantize_rowwise"](x(64, 96), qdtype, activation, wrap=wrap)
            for want_act in (False, True):
                for impl in ("rows", "tiles"):
                    cuda["act_backward_quantize_colsum"](
                        x(64, 96), x(64, 96), qdtype, activation, want_act, impl, wrap=wrap
                    )
            a_q, b_q = torch.zeros(64, 32, dtype=qdtype), torch.zeros(96, 32, dtype=qdtype)
            scales = torch.ones(64), torch.ones(96)
            cuda["scaled_matmul_act_backward"](
                a_q, b_q, *scales, x(64, 96), qdtype, activation, True, False, "triton", "auto", wrap=wrap
            )
    traceable = {op.name for op in library.OPS if op.traceable}
    assert called == traceable, f"extend _launches to the traceable operators {sorted(traceable - called)}"
    return recorded


def _answer_form(found):
    """An analysis answer as comparable lists: torch 2.6-2.12's written names, or 2.13's reads, writes and
    epilogue flag."""
    if isinstance(found, list):
        return found
    rw = found.read_writes
    return [dep.name for dep in rw.reads], [dep.name for dep in rw.writes], found.can_fuse_epilogue


def _torchs_answer(kernel, kwargs):
    """torch's own analysis of one launch."""
    return _answer_form(kernel_access.torch_analysis()(kernel, dict(kwargs), {}))


def _declared_answer(kernel, kwargs):
    answer = kernel_access._answering(_unreachable, _answer_kind())
    return _answer_form(answer(kernel, dict(kwargs), {}))


def _answer_kind() -> str:
    return kernel_access._torch_function()[2]


def _unreachable(*args, **kwargs):
    raise AssertionError("a declared kernel's launch reached torch's analysis")


def _function(kernel):
    return kernel_access.python_function(kernel)


def test_every_launch_of_our_operators_is_declared_as_torch_analyzes_it(sm90_target, launches):
    if kernel_access.torch_analysis() is None:
        pytest.skip("this torch has no analysis function of a known signature (the declarations stay unused)")
    kernels = {_function(kernel).__name__ for kernel, _ in launches}
    assert len(kernels) >= 10  # every traced kernel: GEMM, LayerNorm, row, column, activation passes
    checked = set()
    for kernel, kwargs in launches:
        assert kernel_access.declared(kernel, kwargs) is not None, _function(kernel).__name__
        # one analysis per (kernel, flags, which pointers are tensors): enough to cover each declaration's cases
        signature = (
            _function(kernel),
            tuple(
                sorted(
                    (k, str(v)) for k, v in kwargs.items() if not isinstance(v, (torch.Tensor, int, float))
                )
            ),
            tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, bool))),
            tuple(sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))),
        )
        if signature in checked:
            continue
        checked.add(signature)
        assert _declared_answer(kernel, kwargs) == _torchs_answer(kernel, kwargs), _function(kernel).__name__
    assert len(checked) >= 25  # the flag combinations above, per kernel


def _launch_of(launches, kernel):
    function = _function(kernel)
    return next((k, dict(kw)) for k, kw in launches if _function(k) is function)


def test_a_launch_without_a_flag_its_declaration_reads_goes_to_torch(launches):
    kernel, kwargs = _launch_of(launches, quantize._act_backward_rows_kernel)
    assert kernel_access.declared(kernel, kwargs) is not None
    del kwargs["WRITE_A"]
    assert kernel_access.declared(kernel, kwargs) is None


def test_the_answer_names_only_tensors_of_the_launch_in_argument_order(launches):
    kernel, kwargs = _launch_of(launches, quantize._act_backward_rows_kernel)
    reads, writes = kernel_access.declared(kernel, {**kwargs, "WRITE_A": True})
    assert writes == ["gh_ptr", "act_ptr", "q_ptr", "s_ptr", "part_ptr"] and reads == ["g_ptr", "h_ptr"]
    reads, writes = kernel_access.declared(kernel, {**kwargs, "WRITE_A": False, "q_ptr": None})
    assert writes == ["gh_ptr", "s_ptr", "part_ptr"]


def test_declaring_a_name_the_kernel_lacks_is_refused():
    def kernel(x_ptr, y_ptr, FLAG):
        pass

    with pytest.raises(ValueError, match=r"\['z_ptr'\] are not parameters of kernel"):
        kernel_access.declare_access(reads=("x_ptr",), writes=("z_ptr",))(kernel)
    with pytest.raises(ValueError, match=r"\['OTHER'\]"):
        kernel_access.declare_access(reads=(kernel_access.when("OTHER", "x_ptr"),), writes=("y_ptr",))(kernel)


def _foreign_kernel(x_ptr):  # a kernel of another library: not declared
    pass


def test_installed_it_answers_our_kernels_and_hands_the_rest_to_torch(monkeypatch, launches):
    if kernel_access._torch_function() is None:
        pytest.skip("this torch has no analysis function of a known signature")
    kernel_access.uninstall()
    module, name, _ = kernel_access._torch_function()
    handed = []

    def torchs(kernel, kwargs, tma_descriptor_metadata):  # stands in for torch's analysis
        handed.append(kernel)
        return ["x_ptr"]

    monkeypatch.setattr(module, name, torchs)
    try:
        assert kernel_access.install() and kernel_access.install()  # once: a second install wraps nothing
        installed = getattr(module, name)
        assert installed.hf_switchback_original is torchs
        kernel, kwargs = _launch_of(launches, quantize._rowwise_kernel)
        answer = installed(kernel, kwargs, {})
        writes = answer if isinstance(answer, list) else [d.name for d in answer.read_writes.writes]
        assert writes == ["q_ptr", "s_ptr"] and handed == []
        assert installed(_foreign_kernel, {"x_ptr": torch.empty(1)}, {}) == ["x_ptr"]
        assert installed(kernel, kwargs, {"x_ptr": ("stable", ([64, 64],))}) == ["x_ptr"]  # TMA descriptors
        assert handed == [_foreign_kernel, kernel]
        assert kernel_access.stats == {"declared": 1, "passed_on": 2}
    finally:
        kernel_access.uninstall()
    assert getattr(module, name) is torchs


def test_the_switch_leaves_torchs_analysis_alone(monkeypatch):
    kernel_access.uninstall()
    monkeypatch.setenv("HF_SWITCHBACK_DECLARED_ACCESS", "0")
    before = kernel_access.torch_analysis()
    assert not kernel_access.install()
    found = kernel_access._torch_function()
    if found is not None:
        assert getattr(found[0], found[1]) is before


@pytest.mark.gpu
def test_gpu_a_compiled_layer_generates_no_ttir_for_our_kernels_and_computes_the_same(monkeypatch):
    from test_ttir_cache import compiled_step, small_layer_and_input

    layer, x = small_layer_and_input()
    kernel_access.uninstall()
    ttir_cache.uninstall()
    # torch's analysis first (the process's first trace installs nothing with the switch off)
    monkeypatch.setenv("HF_SWITCHBACK_DECLARED_ACCESS", "0")
    monkeypatch.setenv("HF_SWITCHBACK_TTIR_CACHE", "0")
    analyzed = compiled_step(layer, x)
    monkeypatch.delenv("HF_SWITCHBACK_DECLARED_ACCESS")
    assert kernel_access.install()  # (the process's first trace installs it once; that was done above)
    generated = []
    original = triton_kernel_wrap.generate_ttir
    monkeypatch.setattr(
        triton_kernel_wrap,
        "generate_ttir",
        lambda kernel, *a, **k: generated.append(kernel) or original(kernel, *a, **k),
    )
    try:
        declared = compiled_step(layer, x)
        assert kernel_access.stats["declared"] > 0 and kernel_access.stats["passed_on"] == 0
        assert generated == []
    finally:
        kernel_access.uninstall()
    for got, want in zip(declared, analyzed, strict=True):
        assert torch.equal(got, want)
