"""Inductor's tiled kernels that write 8-bit values get one launch config: not six to compile and to time.

A pointwise kernel that reads along one dimension and writes along the other (a transposed copy) is tiled by
Inductor in two dimensions, and unless it is a plain copy (input, output and two sizes: `TileHint.SQUARE`),
Triton compiles it for six tile shapes and the first launch times each (`triton_heuristics.pointwise`, torch
2.6-2.13). In a compiled SwitchBack graph the kernels of that kind are the weight quantizes of the grad-input
GEMM: the master weight divided by its scale, rounded and stored transposed in 8 bits (weight, scale, output,
two sizes), one per weight shape, on weights small enough that the tile shape hardly matters. With our
activation backward kernel they were the slowest kernels of the backward graphs to compile (0.6-0.95 s each in the
workers at ViT-B/16; BENCHMARKS.md, compile warm-up), and a graph waits for its slowest kernel.

`install()` puts a function in front of Inductor's `TritonKernel.codegen_kernel` that generates a pointwise
kernel tiled in two dimensions with an 8-bit output under Inductor's own setting `triton.autotune_pointwise`
off: one 32 x 32 tile, what Inductor gives a plain transposed copy, in graphs that launch one of our kernels (a
SwitchBack layer's; another library's 8-bit casts in a graph of its own keep torch's tuning). Every other kernel
is generated as before, and max-autotune still tries all tile shapes (torch's rule). The setting is part of the
compile caches' key of SwitchBack graphs (graph_leaf.source_key), so a cached graph is one compiled the same way.
HF_SWITCHBACK_TUNE_TILED_QUANTIZE=1 leaves torch's function alone.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import weakref
from collections.abc import Callable

import torch

from .in_front import FunctionInFront
from .kernel_access import of_this_package

_EIGHT_BIT = frozenset(
    getattr(torch, name)
    for name in ("int8", "uint8", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
# Since install: kernels generated with one config (benchmarks and tests read it).
stats = {"one_config": 0}
logger = logging.getLogger(__name__)
# Inductor's graph being lowered -> whether it launches one of our kernels (asked once per graph, not per kernel)
_graphs_with_ours: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_tiled_8bit_write(kernel) -> bool:
    """Whether Inductor's `kernel` (a TritonKernel about to be generated) is pointwise, tiled in two dimensions,
    and writes an 8-bit buffer. False where any of it cannot be read."""
    try:
        from torch._inductor.virtualized import V

        if kernel.inside_reduction:
            return False
        tiled = [prefix for prefix in kernel.numels if not prefix.startswith("r")]  # "r", "r0_": reductions
        if len(tiled) != 2:
            return False
        return any(V.graph.get_dtype(name) in _EIGHT_BIT for name in kernel.args.output_buffers)
    except Exception:  # another torch's kernel object: generate it as torch would
        logger.debug("tiled_quantize_configs: could not read a kernel's shape", exc_info=True)
        return False


def launches_our_kernels(graph_lowering) -> bool:
    """Whether Inductor's graph (a GraphLowering) calls a Triton kernel of this package: only such a graph (one
    with SwitchBack ops) has its tiled 8-bit writes generated with one config."""
    known = _graphs_with_ours.get(graph_lowering)
    if known is None:
        import torch

        calls = graph_lowering.graph.find_nodes(
            op="call_function", target=torch.ops.higher_order.triton_kernel_wrapper_mutation
        )
        known = any(of_this_package(node.kwargs["kernel_idx"]) for node in calls)
        _graphs_with_ours[graph_lowering] = known
    return known


def _in_a_graph_of_ours() -> bool:
    try:
        from torch._inductor.virtualized import V

        return launches_our_kernels(V.graph)
    except Exception:  # another torch's graph object: generate the kernel as torch would
        logger.debug("tiled_quantize_configs: could not read the graph's kernel calls", exc_info=True)
        return False


def _one_config_for_tiled_8bit(codegen_kernel: Callable) -> Callable:
    @functools.wraps(codegen_kernel)
    def codegen(self, *args, **kwargs):
        original = codegen.hf_switchback_original
        if not (front.active and is_tiled_8bit_write(self) and _in_a_graph_of_ours()):
            return original(self, *args, **kwargs)
        from torch._inductor import config

        with config.patch({"triton.autotune_pointwise": False}):
            code = original(self, *args, **kwargs)
        stats["one_config"] += 1
        return code

    return codegen


front = FunctionInFront(_one_config_for_tiled_8bit)  # in front of TritonKernel.codegen_kernel


def _kernel_class():
    """Inductor's TritonKernel where its codegen_kernel and the setting are the known ones, else None."""
    try:
        from torch._inductor import config
        from torch._inductor.codegen.triton import TritonKernel
    except ImportError:
        return None
    codegen_kernel = getattr(TritonKernel, "codegen_kernel", None)
    if codegen_kernel is None or not hasattr(config.triton, "autotune_pointwise"):
        return None
    original = getattr(codegen_kernel, "hf_switchback_original", codegen_kernel)
    try:
        names = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return None
    return TritonKernel if names[:2] == ["self", "name"] else None


def install() -> bool:
    """Generate tiled 8-bit kernels with one config from now on (once). False where this torch's Inductor
    differs from the known one, or HF_SWITCHBACK_TUNE_TILED_QUANTIZE=1."""
    if os.environ.get("HF_SWITCHBACK_TUNE_TILED_QUANTIZE", "0") == "1":
        return False
    kernel_class = _kernel_class()
    if kernel_class is None:
        return False
    front.install(kernel_class, "codegen_kernel")
    return True


def is_installed() -> bool:
    return front.is_installed()


def uninstall() -> None:
    """Generate every kernel as torch does again, restoring torch's function where ours is still the one in front
    (tests)."""
    front.uninstall(_kernel_class(), "codegen_kernel")
    stats.update(one_config=0)


__all__ = ["install", "is_installed", "is_tiled_8bit_write", "stats", "uninstall"]
