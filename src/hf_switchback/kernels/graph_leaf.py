"""SwitchBack's ops as single calls in the graph that Dynamo records.

Dynamo interprets the Python of whatever a compiled forward calls, one bytecode at a time, including each
`autograd.Function`'s forward and backward: the SwitchBack linear, its kernel-set routes and its backward cost
Dynamo about 0.065 s of CPU per linear, seven times a stock encoder layer's whole trace (BENCHMARKS.md, Whole
training step: compile warm-up). Its work is not cached between processes, so every start pays it, the warm
start too. Under torch.compile each op registered here is instead one call of `_leaf`, which Dynamo is told to
put into its graph as it is (`torch._dynamo.allow_in_graph`): Dynamo runs it once on fake tensors for the
output shapes and records one node; AOT autograd then traces the op, forward and backward, in plain Python
when it builds the joint graph, which its cache keeps. The graph Inductor compiles holds the same operators
as before.

The public ops (functional.switchback_linear and switchback_mlp, blocks' q/k/v, fc1 + activation and producers)
register their whole call as a leaf, input checks, dtype choices and the token floor's path choice included,
with the SwitchBackConfig as an argument: Dynamo then interprets none of that Python either (it did about 500
bytecode steps per linear, 3,000 of an int8 encoder layer's 5,600); the call's inner op is a leaf of its own
that the outer one calls like any function.

While a leaf runs (Dynamo's fake run and AOT's trace), `compiling()` is true, so the op picks the kernel set
for compiled graphs (kernels/backends.py); its autograd backward, which AOT traces after the leaf returned,
keeps the kernel set its forward picked. Outside torch.compile `call` runs the op directly.

A leaf's arguments are what a graph node can hold: tensors, None, constants (bool, int, float, str,
torch.dtype), tuples of them and the frozen dataclasses of `argument_class` (KernelOptions, SwitchBackConfig:
Dynamo's graph builds them from their fields). Dynamo does not
look inside a leaf, so a leaf must not read state that can change between calls other than through its
arguments; a kernel twin patched at run time (tests do this) is therefore not seen by a graph already traced,
and the caches key a traced graph by the package's files, not by such patches. `compiling()` reads one counter
for the process: eager code in another thread while a leaf is being traced would take the compiled kernel set
(correct results, another code path). This module imports only kernels/options.py and the six modules that
meet torch.compile's internals (kernels/kernel_access.py, early_compile.py, ttir_cache.py,
tiled_quantize_configs.py, direct_kernel_calls.py, graph_repro.py) from the package, and torch._dynamo only once torch.compile
already traces (it imports triton where installed).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import torch

from . import (
    direct_kernel_calls,
    early_compile,
    graph_repro,
    kernel_access,
    tiled_quantize_configs,
    ttir_cache,
)
from .options import KernelOptions

_OPS: dict[str, Callable] = {}
# Classes whose instances leaves take as arguments (frozen dataclasses: Dynamo's graph builds them from their
# fields), marked cacheable with the leaf: KernelOptions, and SwitchBackConfig (functional.py adds it).
_ARGUMENT_CLASSES: list[type] = [KernelOptions]
_depth = 0  # leaves running now (a leaf's op may call another's)
_registered = False


def op(name: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as the op `name`, to be run by `call`."""

    def register(function: Callable) -> Callable:
        if name in _OPS:
            raise ValueError(f"graph_leaf: op {name!r} is registered twice")
        _OPS[name] = function
        return function

    return register


def argument_class(cls: type) -> type:
    """Let leaves take instances of `cls` (a frozen dataclass of constants) as arguments; returns `cls`."""
    if cls not in _ARGUMENT_CLASSES:
        _ARGUMENT_CLASSES.append(cls)
    return cls


def compiling() -> bool:
    """Whether the ops are being traced for a compiled graph: inside Dynamo's trace or a leaf."""
    return _depth > 0 or torch.compiler.is_compiling()


def _leaf(name: str, *args):
    global _depth
    _depth += 1
    try:
        return _OPS[name](*args)
    finally:
        _depth -= 1


@functools.cache
def source_key() -> str:
    """A hash of the package's files (code and the shipped tables) and of the switch that changes our graphs'
    generated code: what a leaf's traced graph depends on beyond its arguments, the torch version and the GPU,
    which torch's cache keys hold already. Read once per process."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".json")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    # the one switch that changes the code Inductor generates for our graphs (kernels/tiled_quantize_configs.py)
    digest.update(os.environ.get("HF_SWITCHBACK_TUNE_TILED_QUANTIZE", "0").encode())
    return digest.hexdigest()[:16]


def _register_with_dynamo() -> bool:
    """Dynamo calls this as a constant (it does not trace it) at every trace that reaches a leaf, before `_leaf`."""
    global _registered
    import torch._dynamo
    import torch._inductor.config as inductor_config

    if not _registered:
        torch._dynamo.allow_in_graph(_leaf)
        kernel_access.install()  # what our Triton kernels read and write, declared: no analysis by torch
        early_compile.install()  # our kernels' compiles start when Inductor writes their launch
        ttir_cache.install()  # torch's analysis of any other call on our kernels, once per specialization
        tiled_quantize_configs.install()  # Inductor's transposed 8-bit writes: one tile config, not six
        direct_kernel_calls.install()  # our kernels' calls made mutating without torch's per-call tracing
        graph_repro.install()  # torch's runnable copy of each graph written only where a trace log reads it
        _registered = True
    # AOT autograd's and Inductor's caches refuse graphs that call functions they do not know, unless marked
    # cacheable with a key of the caller's choosing: a graph of leaves is then cached, keyed by this package's
    # files (a new release or an edited kernel misses the old entries); the argument classes too, which Dynamo's
    # graph builds for the leaf. Checked at every trace: a patched inductor config may have dropped the marks.
    marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if marked is not None:
        ours = {f"{f.__module__}.{f.__qualname__}": source_key() for f in (_leaf, *_ARGUMENT_CLASSES)}
        if any(marked.get(name) != key for name, key in ours.items()):
            inductor_config.unsafe_marked_cacheable_functions = {**marked, **ours}
    return True


# torch.compiler.assume_constant_result without calling it: importing torch._dynamo at import time would import
# triton on the CPU path (kernels/backends.py does the same for _use_triton).
_register_with_dynamo._dynamo_marked_constant = True


def call(name: str, *args):
    """Run the op `name` on `args`: one node of Dynamo's graph under torch.compile, a plain call elsewhere."""
    if torch.compiler.is_compiling() and _register_with_dynamo():
        return _leaf(name, *args)
    return _OPS[name](*args)


__all__ = ["argument_class", "call", "compiling", "op"]
