"""Tell torch's `triton_op` which Triton kernels our operators launch, instead of letting it find them.

When an operator is declared with `torch.library.triton_op`, torch (2.11 and later) parses the source of its
body, and of every function the body calls, to list the Triton kernels it launches
(`torch._library.triton.get_inner_triton_kernels`). The list serves one purpose: AOT autograd's cache hashes
those kernels' sources for a Dynamo graph that calls the operator directly. For our eleven traceable operators
the parse took ~0.25 s of CPU on a workstation (torch 2.13), paid by every process at its first SwitchBack step
on CUDA (the declaration is lazy), the warm compiled start included (BENCHMARKS.md, Compile warm-up), and found
nothing: our bodies launch their kernels through helpers, which the parse does not follow.

While `named` is active, each declaration gets `kernels` instead: every Triton kernel of this package, a superset
of what any one operator launches, so the cache key of such a graph still changes whenever one of them does.
(Our own graphs call the operators inside graph leaves, keyed by the package's files: kernels/graph_leaf.py.)
A torch without the function is left as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def named(kernels: Sequence[object]) -> Iterator[None]:
    """Within the block, triton_op declarations list `kernels` as what they launch, without parsing sources."""
    import torch._library.triton as triton_library

    original = getattr(triton_library, "get_inner_triton_kernels", None)
    if original is None:
        yield
        return
    triton_library.get_inner_triton_kernels = lambda fn: list(kernels)
    try:
        yield
    finally:
        triton_library.get_inner_triton_kernels = original


def of_modules(*modules) -> list[object]:
    """The Triton kernels (jit functions and autotuners) defined in `modules`, in definition order."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    return [
        value
        for module in modules
        for value in vars(module).values()
        if isinstance(value, (JITFunction, Autotuner))
    ]


__all__ = ["named", "of_modules"]
