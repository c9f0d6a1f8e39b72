"""kernels/early_compile.py: our Triton kernels handed to Inductor's compile workers when their launch is written.

The CPU tests build a kernel definition the way torch writes one for a user-defined kernel (the source spliced
into `async_compile.triton('name', '''...''')`, its triple quotes escaped) and check that what the module reads
from it is what Python itself evaluates; that only kernels whose file is in this package are taken; and that the
function in front of torch's define_kernel hands such a kernel to the pool once and passes every call on
unchanged. The GPU test compiles a SwitchBack layer with the workers ready and checks that each of our kernels
was submitted before the graph's module asked for it, with the same text (so it compiled once), and that the
layer computes what it computes without the early start.
"""

import functools
import textwrap
from pathlib import Path

import pytest
import torch

from hf_switchback.kernels import early_compile

wrapper_module = pytest.importorskip("torch._inductor.codegen.wrapper")
async_compile_module = pytest.importorskip("torch._inductor.async_compile")
PythonWrapperCodegen = wrapper_module.PythonWrapperCodegen
AsyncCompile = async_compile_module.AsyncCompile

_PACKAGE = Path(early_compile.__file__).resolve().parents[1]
_OUR_KERNEL_FILE = _PACKAGE / "kernels" / "matmul.py"

# A kernel source with what torch's splicing has to survive: triple quotes and a backslash escape in a string.
_KERNEL_SOURCE = textwrap.dedent(
    '''\
    @triton.jit
    def _scaled_mm_kernel(a_ptr, b_ptr, M, BLOCK: tl.constexpr):
        """Doc with \'\'\'quotes\'\'\' and a tab\\t."""
        pid = tl.program_id(0)

        tl.store(a_ptr + pid, tl.load(b_ptr + pid))
    '''
)


def _definition(name: str, source: str, device: str = "cuda") -> str:
    """A kernel definition as torch's define_user_defined_triton_kernel writes it (wrapper.py, torch 2.11-2.13)."""
    from torch._inductor.utils import IndentedBuffer

    body = IndentedBuffer()
    body.writeline(f"async_compile.triton({name!r}, '''")
    body.splice("import triton\nimport triton.language as tl\n")
    body.splice(source.replace("'''", "\\'\\'\\'"))
    body.writeline(f"''', device_str='{device}')")
    return body.getvalue()


def _evaluated(definition: str):
    """What the graph's module passes when it runs the definition: the text as torch places it in the module
    (its header), run by Python (the reference)."""
    from torch._inductor.utils import IndentedBuffer

    seen = []

    class _Recorder:
        def triton(self, name, source, **keywords):
            seen.append((name, source, keywords))

    module = IndentedBuffer()
    module.splice(
        PythonWrapperCodegen._format_kernel_definition("kernel", definition, "# Original path: k.py:1")
    )
    exec(module.getvalue(), {"async_compile": _Recorder()})  # text this test wrote
    (call,) = seen
    return call


def test_compile_call_reads_what_the_module_will_pass():
    definition = _definition("_scaled_mm_kernel_3", _KERNEL_SOURCE)
    assert early_compile.compile_call(definition) == _evaluated(definition)
    name, source, keywords = early_compile.compile_call(definition)
    assert name == "_scaled_mm_kernel_3" and keywords == {"device_str": "cuda"}
    assert "'''quotes'''" in source  # the escaped triple quotes read back


@pytest.mark.parametrize(
    "text",
    [
        "async_compile.cpp_pybinding(['void'], '''int x;''')",  # another compiler's definition
        "async_compile.triton(name, '''src''')",  # a name that is not a literal
        "async_compile.triton('k', '''src''', device_str=device)",
        "x = 1\nasync_compile.triton('k', '''src''')",  # more than the one call
        "async_compile.triton('k', '''unterminated",
        "other.triton('k', '''src''')",
        "async_compile.triton('k', '''a\x00b''')",  # a null byte: Python refuses the text
    ],
)
def test_compile_call_refuses_other_text(text):
    assert early_compile.compile_call(text) is None


def test_only_kernels_whose_file_is_in_this_package_are_ours():
    assert early_compile.is_ours(f"# Original path: {_OUR_KERNEL_FILE}:120")
    assert not early_compile.is_ours(
        f"# Original path: {Path(torch.__file__).parent / 'nn' / 'functional.py'}:9"
    )
    assert not early_compile.is_ours(
        f"# Original path: {_PACKAGE}_fork/kernels/matmul.py:120"
    )  # a name prefix
    assert not early_compile.is_ours(None)
    assert not early_compile.is_ours("# kernel path: /tmp/x.py")  # what torch writes above its own kernels


@pytest.fixture
def installed():
    was = early_compile.is_installed()  # (the test run's first compile installed it where one ran)
    early_compile.uninstall()
    assert early_compile.install()
    yield
    early_compile.uninstall()
    if was:
        early_compile.install()


def test_our_kernel_goes_to_the_pool_once_and_every_definition_on_to_torch(installed, monkeypatch):
    submitted, defined = [], []
    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: True))
    monkeypatch.setattr(AsyncCompile, "triton", lambda self, *a, **k: submitted.append((a, k)))
    monkeypatch.setattr(
        PythonWrapperCodegen.define_kernel, "hf_switchback_original", lambda *a, **k: defined.append((a, k))
    )
    ours = _definition("_scaled_mm_kernel_0", _KERNEL_SOURCE)
    theirs = _definition("_other_kernel_0", _KERNEL_SOURCE.replace("_scaled_mm", "_other"))
    codegen = object.__new__(PythonWrapperCodegen)  # define_kernel's own body is replaced above
    codegen.define_kernel("_scaled_mm_kernel_0", ours, f"# Original path: {_OUR_KERNEL_FILE}:10")
    codegen.define_kernel("_other_kernel_0", theirs, "# Original path: /site-packages/other/kernels.py:10")
    codegen.define_kernel("triton_poi_fused_0", theirs, "# kernel path: /tmp/c.py", gpu=True)
    name, source, keywords = _evaluated(ours)
    assert submitted == [((name, source), keywords)]
    assert [a[1:] for a, _ in defined] == [
        ("_scaled_mm_kernel_0", ours, f"# Original path: {_OUR_KERNEL_FILE}:10"),
        ("_other_kernel_0", theirs, "# Original path: /site-packages/other/kernels.py:10"),
        ("triton_poi_fused_0", theirs, "# kernel path: /tmp/c.py"),
    ]
    assert defined[2][1] == {"gpu": True}
    assert early_compile.stats["submitted"] == 1


def test_nothing_is_submitted_before_the_pool_is_ready(installed, monkeypatch):
    submitted = []
    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: False))
    monkeypatch.setattr(AsyncCompile, "triton", lambda self, *a, **k: submitted.append(a))
    monkeypatch.setattr(PythonWrapperCodegen.define_kernel, "hf_switchback_original", lambda *a, **k: None)
    codegen = object.__new__(PythonWrapperCodegen)
    codegen.define_kernel("k", _definition("k", _KERNEL_SOURCE), f"# Original path: {_OUR_KERNEL_FILE}:1")
    assert submitted == []  # the module's own call compiles it, as without the early start


def test_the_switch_leaves_torchs_function_alone(installed, monkeypatch):
    early_compile.uninstall()
    monkeypatch.setenv("HF_SWITCHBACK_EARLY_KERNEL_COMPILE", "0")
    assert not early_compile.install() and not early_compile.is_installed()
    assert not hasattr(PythonWrapperCodegen.define_kernel, "hf_switchback_original")
    monkeypatch.delenv("HF_SWITCHBACK_EARLY_KERNEL_COMPILE")
    assert early_compile.install() and early_compile.install()  # twice: wrapped once
    assert not hasattr(PythonWrapperCodegen.define_kernel.hf_switchback_original, "hf_switchback_original")
    early_compile.uninstall()
    assert not hasattr(PythonWrapperCodegen.define_kernel, "hf_switchback_original")


def test_a_definition_of_another_form_is_counted_and_defined_as_before(installed, monkeypatch):
    submitted, defined = [], []
    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: True))
    monkeypatch.setattr(AsyncCompile, "triton", lambda self, *a, **k: submitted.append(a))
    monkeypatch.setattr(
        PythonWrapperCodegen.define_kernel, "hf_switchback_original", lambda *a, **k: defined.append(a[1])
    )
    codegen = object.__new__(PythonWrapperCodegen)
    body = "async_compile.triton_v2('k', '''src''')"  # a torch that writes its definitions otherwise
    codegen.define_kernel("k", body, f"# Original path: {_OUR_KERNEL_FILE}:1")
    assert submitted == [] and defined == ["k"]
    assert early_compile.stats == {"submitted": 0, "not_read": 1}


def test_uninstalled_under_another_wrapper_ours_passes_every_call_on(installed, monkeypatch):
    submitted, defined = [], []
    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: True))
    monkeypatch.setattr(AsyncCompile, "triton", lambda self, *a, **k: submitted.append(a))
    ours = PythonWrapperCodegen.define_kernel
    monkeypatch.setattr(ours, "hf_switchback_original", lambda *a, **k: defined.append(a[1]))

    @functools.wraps(ours)  # copies our attributes too
    def theirs(*args, **kwargs):
        return ours(*args, **kwargs)

    monkeypatch.setattr(PythonWrapperCodegen, "define_kernel", theirs)
    early_compile.uninstall()
    assert PythonWrapperCodegen.define_kernel is theirs  # not taken out from under them
    codegen = object.__new__(PythonWrapperCodegen)
    codegen.define_kernel("k", _definition("k", _KERNEL_SOURCE), f"# Original path: {_OUR_KERNEL_FILE}:1")
    assert submitted == [] and defined == ["k"]


@pytest.mark.gpu
def test_gpu_a_compiled_layer_submits_our_kernels_early_and_compiles_each_once(monkeypatch):
    from test_ttir_cache import compiled_step, small_layer_and_input

    from hf_switchback.compile_cache import start_compile_workers

    if not hasattr(AsyncCompile, "wait_pool_ready") or not start_compile_workers():
        pytest.skip("this torch cannot start its compile workers ahead of the first compile")
    AsyncCompile.wait_pool_ready()
    layer, x = small_layer_and_input()
    was = early_compile.is_installed()
    early_compile.uninstall()
    # (switched off: the process's first trace would install it)
    monkeypatch.setenv("HF_SWITCHBACK_EARLY_KERNEL_COMPILE", "0")
    late = compiled_step(layer, x)
    monkeypatch.delenv("HF_SWITCHBACK_EARLY_KERNEL_COMPILE")
    assert early_compile.install()
    calls = []  # (kernel name, source, whether a compile of that text was already under way)
    compiling = async_compile_module.CompiledTritonKernels
    original = AsyncCompile.triton

    def recording(self, name, source, *args, **kwargs):
        calls.append((name, source, compiling.get(source) is not None))
        return original(self, name, source, *args, **kwargs)

    monkeypatch.setattr(AsyncCompile, "triton", recording)
    try:
        early = compiled_step(layer, x)
        submitted = early_compile.stats["submitted"]
    finally:
        early_compile.uninstall()  # (which zeroes the count)
        if was:
            early_compile.install()
    ours = {source for name, source, _ in calls if name.startswith("_") and "_kernel" in name}
    summary = [(name, already) for name, _, already in calls]

    # Each graph that launches one of our kernels submits it early, then its module's call finds that compile
    # under way: a text that differed would start a second compile instead (two submissions, no find).
    for source in ours:
        seen = [already for _, text, already in calls if text == source]
        assert seen and seen == [False, True] * (len(seen) // 2), (source[:120], seen, summary)
    pairs = sum(already for _, text, already in calls if text in ours)
    assert submitted == pairs and len(ours) >= 3, summary  # LayerNorm-quantize, GEMM, act-quantize at least
    # The same kernels: Inductor may autotune its own reductions to another config in the second compile.
    for got, want in zip(early, late, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)


def test_a_failed_head_start_leaves_the_kernel_to_the_modules_own_call(installed, monkeypatch):
    defined = []

    def refuse(self, *args, **kwargs):
        raise RuntimeError("SubprocPool closed")

    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: True))
    monkeypatch.setattr(AsyncCompile, "triton", refuse)
    monkeypatch.setattr(
        PythonWrapperCodegen.define_kernel, "hf_switchback_original", lambda *a, **k: defined.append(a[1])
    )
    codegen = object.__new__(PythonWrapperCodegen)
    codegen.define_kernel("k", _definition("k", _KERNEL_SOURCE), f"# Original path: {_OUR_KERNEL_FILE}:1")
    assert defined == ["k"] and early_compile.stats["submitted"] == 0
