"""torch's runnable copy of each compiled graph, written only where its trace log will read it.

For every graph it compiles, Inductor writes a runnable Python copy of the graph
(`torch._dynamo.repro.after_aot.save_graph_repro`, the `fx_graph_runnable` artifact of torch's structured trace
log, TORCH_TRACE / tlparse) and keeps it in the graph's cache entry, whether or not that log is on (torch 2.11 to
2.13). The copy holds the source of every user-defined Triton kernel that torch's kernel table knows in the
process, each parsed again for the kernels it calls, and the constant arguments of every such call made so far:
for a SwitchBack layer's graph 110-184 kB and 0.05-0.08 s, 0.24 s of a cold ViT-B/16 int8 first step against
0.01 s for bf16's (four graphs each; BENCHMARKS.md, compile warm-up).

`install()` puts a function in front of it that, for Inductor's own call (compiler "inductor", no save_dir)
while the trace log has no handler (any logging handler on it counts, pytest's capture too: torch then builds
its payloads as well) and torch's kernel table holds a kernel of this package, writes one comment
line instead of the copy. With TORCH_TRACE set, torch's copy is written as before; a graph compiled without it
and later loaded from the cache with it shows that line as its `fx_graph_runnable`.
HF_SWITCHBACK_GRAPH_REPRO=1 keeps torch's copy always.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable

from .in_front import FunctionInFront
from .kernel_access import of_this_package

# Since install: copies not written (benchmarks and tests read it).
stats = {"skipped": 0}
PLACEHOLDER = (
    "# hf_switchback: the runnable copy of this graph was not written (no TORCH_TRACE when it was compiled; "
    "HF_SWITCHBACK_GRAPH_REPRO=1 writes it always)\n"
)
_NAME = "save_graph_repro"


def _needed(compiler_name, kwargs) -> bool:
    """Whether torch's copy may be read: another caller than Inductor's compile, or the trace log on, or no
    kernel of ours in the table (a graph of someone else's, left as torch writes it)."""
    if compiler_name != "inductor" or kwargs.get("save_dir", 0) is not None or trace_log_reads():
        return True
    return not table_holds_ours()


def trace_log_reads(handlers: list | None = None) -> bool:
    """Whether torch's structured trace log (or `handlers`) has a handler that may write the copy somewhere: the
    test torch makes before it builds a record's payload, except for torch's lazy handler of a process without
    TORCH_TRACE (no folder), attached at import, which takes itself off at the log's first record unwritten."""
    if handlers is None:
        from torch._logging._internal import trace_log

        handlers = trace_log.handlers
    return any(
        not (type(handler).__name__ == "LazyTraceHandler" and getattr(handler, "root_dir", None) is None)
        for handler in handlers
    )


def table_holds_ours() -> bool:
    """Whether torch's table of user-defined Triton kernels holds one of this package's."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    return any(of_this_package(index) for index in list(kernel_side_table.id_to_kernel))


def _only_when_read(save_graph_repro: Callable) -> Callable:
    @functools.wraps(save_graph_repro)
    def save_when_read(fd, gm, args, compiler_name, *rest, **kwargs):
        if front.active and not rest and not _needed(compiler_name, kwargs):
            fd.write(PLACEHOLDER)
            stats["skipped"] += 1
            return None
        return save_when_read.hf_switchback_original(fd, gm, args, compiler_name, *rest, **kwargs)

    return save_when_read


front = FunctionInFront(_only_when_read)  # in front of torch._dynamo.repro.after_aot.save_graph_repro


def _after_aot_module():
    """torch's module where Inductor finds save_graph_repro with the known signature and our test's pieces are,
    else None."""
    try:
        import torch._dynamo.repro.after_aot as after_aot
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table  # noqa: F401
        from torch._logging._internal import trace_log  # noqa: F401
    except ImportError:
        return None
    save = getattr(after_aot, _NAME, None)
    if not callable(save):
        return None
    try:  # (ours, if in front, has torch's signature through functools.wraps)
        parameters = list(inspect.signature(save).parameters)
    except (TypeError, ValueError):
        return None
    if parameters[:4] != ["fd", "gm", "args", "compiler_name"] or "save_dir" not in parameters:
        return None
    return after_aot


def install() -> bool:
    """Write torch's copy only where it is read, from now on (once). False where this torch lacks the known
    pieces or signature, or HF_SWITCHBACK_GRAPH_REPRO=1."""
    if os.environ.get("HF_SWITCHBACK_GRAPH_REPRO", "0") == "1":
        return False
    after_aot = _after_aot_module()
    if after_aot is None:
        return False
    front.install(after_aot, _NAME)
    return True


def is_installed() -> bool:
    return front.is_installed()


def uninstall() -> None:
    """Let torch write every copy again, restoring its function where ours is still the one in front (tests)."""
    front.uninstall(_after_aot_module(), _NAME)
    stats.update(skipped=0)


__all__ = [
    "PLACEHOLDER",
    "install",
    "is_installed",
    "stats",
    "table_holds_ours",
    "trace_log_reads",
    "uninstall",
]
