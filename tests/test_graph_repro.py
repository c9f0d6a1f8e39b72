"""kernels/graph_repro.py: torch's runnable copy of a compiled graph written only where its trace log reads it.

CPU: torch's function itself, called as Inductor calls it and as other callers do, with and without a handler on
torch's trace log and with and without a kernel of this package in torch's kernel table; an Inductor compile on
the CPU with the table faked to hold ours (the copy is the line, the compiled function computes the same); the
switch, install once, uninstall. GPU: a SwitchBack layer compiled with the copies skipped computes what it
computes with torch's copies written.
"""

import io
import logging

import pytest
import torch

from hf_switchback.kernels import graph_repro

after_aot = pytest.importorskip("torch._dynamo.repro.after_aot")
kernel_wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
trace_log = pytest.importorskip("torch._logging._internal").trace_log


@pytest.fixture
def restored():
    """Leave the function in front of torch's installed or not as the test found it."""
    was = graph_repro.is_installed()
    graph_repro.uninstall()
    yield
    graph_repro.uninstall()
    if was:
        graph_repro.install()


@pytest.fixture
def trace_log_off(monkeypatch):
    """torch's trace log as without handlers (pytest's log capture puts its own on it)."""
    monkeypatch.setattr(graph_repro, "trace_log_reads", lambda: False)


def _graph():
    gm = torch.fx.symbolic_trace(lambda x: x * 2 + 1)
    return gm, [torch.randn(3)]


def _copy(compiler_name="inductor", **kwargs) -> str:
    fd = io.StringIO()
    gm, args = _graph()
    after_aot.save_graph_repro(fd, gm, args, compiler_name, **kwargs)
    return fd.getvalue()


def test_inductors_call_writes_one_line_while_no_trace_log_reads_it(restored, monkeypatch, trace_log_off):
    torchs = _copy(save_dir=None)
    assert "def forward" in torchs and len(torchs) > 10 * len(graph_repro.PLACEHOLDER)
    monkeypatch.setattr(graph_repro, "table_holds_ours", lambda: True)
    assert graph_repro.install()
    assert _copy(save_dir=None) == graph_repro.PLACEHOLDER
    # (at least: CI's captured log showed another Inductor compile running in its xdist worker during such a test,
    # counted under the test's fakes)
    assert graph_repro.stats["skipped"] >= 1


def test_torchs_copy_where_it_is_read_or_not_ours(restored, monkeypatch):
    monkeypatch.setattr(graph_repro, "table_holds_ours", lambda: True)
    assert graph_repro.install()
    monkeypatch.setattr(graph_repro, "trace_log_reads", lambda: True)
    assert "def forward" in _copy(save_dir=None)  # the trace log has a handler
    monkeypatch.setattr(graph_repro, "trace_log_reads", lambda: False)
    assert "def forward" in _copy("aot_eager", save_dir=None)  # another compiler's call
    assert "def forward" in _copy(save_dir="/tmp/repro")  # a repro written to a folder
    monkeypatch.setattr(graph_repro, "table_holds_ours", lambda: False)
    assert "def forward" in _copy(save_dir=None)  # no kernel of ours in the process


def test_the_table_holds_ours_only_with_a_kernel_of_this_package(monkeypatch):
    from hf_switchback.kernels import kernel_access

    monkeypatch.setattr(kernel_access, "python_function", lambda kernel: kernel)
    table = kernel_wrap.kernel_side_table
    monkeypatch.setattr(table, "id_to_kernel", {0: _graph})
    assert not graph_repro.table_holds_ours()
    monkeypatch.setattr(table, "id_to_kernel", {0: _graph, 1: graph_repro.install})
    assert graph_repro.table_holds_ours()


def test_the_trace_log_reads_unless_its_only_handler_is_torchs_lazy_one_without_a_folder():
    from torch._logging._internal import LazyTraceHandler

    unset = LazyTraceHandler(None)  # torch's at import, TORCH_TRACE unset
    assert not graph_repro.trace_log_reads([]) and not graph_repro.trace_log_reads([unset])
    assert graph_repro.trace_log_reads([unset, LazyTraceHandler("/tmp/trace")])  # TORCH_TRACE=/tmp/trace
    assert graph_repro.trace_log_reads([logging.NullHandler()])


def test_an_inductor_compile_writes_the_line_and_computes_the_same(restored, monkeypatch, trace_log_off):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(graph_repro, "table_holds_ours", lambda: True)
    assert graph_repro.install()
    written = []
    ours = after_aot.save_graph_repro

    def recording(fd, *args, **kwargs):
        result = ours(fd, *args, **kwargs)
        written.append(fd.getvalue())
        return result

    monkeypatch.setattr(after_aot, "save_graph_repro", recording)
    x = torch.randn(64)
    torch._dynamo.reset()
    try:
        with inductor_config.patch(force_disable_caches=True):
            y = torch.compile(lambda t: torch.tanh(t) * 2 + 1, backend="inductor")(x)
    finally:
        torch._dynamo.reset()
    assert written == [graph_repro.PLACEHOLDER]
    torch.testing.assert_close(y, torch.tanh(x) * 2 + 1)


def test_the_switch_install_once_and_uninstall(restored, monkeypatch):
    original = after_aot.save_graph_repro
    monkeypatch.setattr(
        after_aot, "save_graph_repro", lambda fd, gm, args: None
    )  # a signature we do not know
    assert not graph_repro.install()
    monkeypatch.setattr(after_aot, "save_graph_repro", original)
    monkeypatch.setenv("HF_SWITCHBACK_GRAPH_REPRO", "1")
    assert not graph_repro.install() and after_aot.save_graph_repro is original
    monkeypatch.delenv("HF_SWITCHBACK_GRAPH_REPRO")
    assert graph_repro.install() and graph_repro.install()
    assert after_aot.save_graph_repro.hf_switchback_original is original
    graph_repro.uninstall()
    assert after_aot.save_graph_repro is original


@pytest.mark.gpu
def test_gpu_a_layer_compiled_without_the_copies_computes_the_same(restored, monkeypatch, trace_log_off):
    from test_ttir_cache import compiled_step, small_layer_and_input

    layer, x = small_layer_and_input()
    monkeypatch.setenv("HF_SWITCHBACK_GRAPH_REPRO", "1")  # (the first trace would install it)
    torchs = compiled_step(layer, x)
    monkeypatch.delenv("HF_SWITCHBACK_GRAPH_REPRO")
    assert graph_repro.install()
    ours = compiled_step(layer, x)
    assert graph_repro.stats["skipped"] >= 2  # each graph Inductor compiled, forward and backward
    for a, b in zip(ours, torchs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
