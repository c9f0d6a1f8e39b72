"""Choose between the torch reference kernels and the Triton kernels.

A kernel set (kernels/library.py's KernelSet) has one function per declared kernel operator, with the
signature of its torch twin in `kernels/reference.py` and a keyword `options`, the caller's KernelOptions.
`library.REFERENCE` runs the twins; the Triton set (`kernels/ops.py`) is imported lazily, so nothing on the
CPU path ever imports triton. While torch.compile traces, CUDA tensors get `kernels/compiled.py`'s set
instead: the reference quantize ops (for Inductor to fuse) with the Triton GEMM launched from Inductor's code.
fp8 GEMMs that cuBLAS runs faster go to `kernels/cublas.py` (options.fp8_gemm).
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys

import torch

from . import graph_leaf, library
from .library import KernelSet
from .options import KernelOptions

logger = logging.getLogger(__name__)

TRITON_MODULE = "hf_switchback.kernels.ops"
COMPILED_MODULE = "hf_switchback.kernels.compiled"


@functools.cache
def triton_unavailable_reason() -> str | None:
    """None when the Triton kernels can run here, else a sentence saying why not."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        importlib.import_module("triton")
    except ImportError as err:
        return f"triton is not installed ({err}); pip install 'hf_switchback[triton]'"
    try:
        importlib.import_module(TRITON_MODULE)
    except ImportError as err:
        return f"the Triton kernels could not be imported ({err})"
    return None


def check_backend(backend: str) -> None:
    """At apply time: fail when backend='triton' cannot run on this machine; where the Triton kernels can run,
    load them now.

    Loading them (importing kernels/ops.py and kernels/compiled.py: Triton's JIT objects, our operators'
    registration with torch) takes ~0.1 s on a GPU host. Left to the first use, it landed inside the first
    compiled step, in Dynamo's first trace; here it is part of setting the model up, as torch's own operators
    are loaded with torch. A machine without CUDA never imports triton (triton_unavailable_reason says so first).
    """
    if backend == "torch":
        return
    reason = triton_unavailable_reason()
    if reason is None:
        importlib.import_module(COMPILED_MODULE)
    elif backend == "triton":
        raise RuntimeError(
            f"SwitchBackConfig.backend='triton' but {reason}. Use backend='auto' to fall back to the "
            "torch reference kernels, or backend='torch'."
        )


@functools.cache
def _warn_fallback_once(reason: str) -> None:
    logger.info("hf_switchback: backend='auto' uses the torch reference kernels (%s).", reason)


def declare_operators() -> dict[str, object]:
    """Declare the kernel operators (with their Triton implementations where they can run) and return them,
    name -> CustomOpDef: what `torch.ops.hf_switchback` holds."""
    triton_unavailable_reason()  # imports kernels/ops.py, which declares them with CUDA implementations
    library.declare()
    return library.declared()


# This package (hf_switchback.kernels): `_PACKAGE.ops` is an attribute once the Triton set has been imported.
_PACKAGE = sys.modules[__name__.rpartition(".")[0]]


def _use_triton(backend: str, device_type: str) -> bool:
    """True when tensors on `device_type` get the Triton kernels under config.backend.

    Raises for backend='triton' where it cannot run. torch.compile runs this once while tracing and keeps the
    answer as a constant, so its imports and caches never reach Dynamo (they would be graph breaks).
    """
    if backend == "torch":
        return False
    if device_type != "cuda":
        if backend == "triton":
            raise RuntimeError(
                f"SwitchBackConfig.backend='triton' needs CUDA tensors, got a tensor on {device_type}. "
                "Move the model to the GPU or use backend='auto'."
            )
        _warn_fallback_once(f"input on {device_type}")
        return False
    reason = triton_unavailable_reason()  # imports the Triton set when it can
    if reason is None:
        importlib.import_module(COMPILED_MODULE)
        return True
    check_backend(backend)
    _warn_fallback_once(reason)
    return False


# What torch.compiler.assume_constant_result does, without calling it: the decorator imports torch._dynamo,
# which imports triton when installed, and the CPU path must never import triton at import time.
_use_triton._dynamo_marked_constant = True


def get_kernels(backend: str, device: torch.device, options: KernelOptions) -> KernelSet:
    """The kernel set for a tensor on `device` under config.backend and the layer's kernel options."""
    if _use_triton(backend, device.type):
        # Under torch.compile the quantize passes are left to Inductor to fuse and our kernels are launched from
        # its code (kernels/compiled.py); compiling() is a trace-time constant there (or true inside a graph leaf,
        # kernels/graph_leaf.py) and False in eager mode.
        if graph_leaf.compiling():
            return _PACKAGE.compiled.KERNELS
        return _PACKAGE.ops.KERNELS
    return library.REFERENCE
