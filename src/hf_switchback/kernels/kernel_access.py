"""Which tensor arguments each of our Triton kernels reads and writes, declared beside the kernel, so that
torch.compile need not work it out.

torch.compile must know which arguments a Triton kernel launched through `wrap_triton` writes (to functionalize
the launch, and for Inductor to order and reuse buffers). For a kernel it knows nothing about, it generates the
kernel's Triton IR (TTIR) and walks it from every store back to the parameters: torch's
`identify_mutated_tensors` (torch 2.6-2.12: the written tensors' names) or `identify_accessed_tensors` (2.13:
the tensors read and written, and whether the single output can take a fused epilogue). Generating the TTIR is
Triton's front end, ~80 ms per kernel specialization on the first sight of each (kernels/ttir_cache.py keeps
it for the repeats): 0.8-1.4 s of the cold first step of a SwitchBack model (BENCHMARKS.md, compile warm-up),
for an answer that is fixed by the kernel's code and its flags.

So each kernel declares its answer (`@declare_access` over its `@triton.jit`): the arguments it reads and writes,
by name, those that a constexpr flag of the launch decides (HAS_BIAS, WRITE_A) as `when(flag, *names)`.
`install()` puts a function in front of torch's that answers for a declared kernel and hands every other call
(another library's kernel, TMA descriptors, a flag the launch did not pass) to torch's. The answer has torch's
form: names in the kernel's argument order, only arguments that are tensors in this launch; the epilogue flag as
torch decides it (one tensor written, and not read). tests/test_kernel_access.py checks each declaration
against torch's own analysis, for every kernel and flag our operators launch with.
HF_SWITCHBACK_DECLARED_ACCESS=0 leaves torch's functions alone (then the TTIR cache serves).

This module never imports triton: the kernel modules declare into it when they are imported.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

_SIGNATURE = ["kernel", "kwargs", "tma_descriptor_metadata"]
# torch's analysis functions, newest first: (name, what the answer holds)
_TORCH_FUNCTIONS = (("identify_accessed_tensors", "accesses"), ("identify_mutated_tensors", "writes"))
# Since install: calls answered from a declaration, calls handed to torch's function (benchmarks read these).
stats = {"declared": 0, "passed_on": 0}


@dataclass(frozen=True)
class When:
    """Parameters accessed only where the launch's constexpr `flag` is true (or nonzero)."""

    flag: str
    names: tuple[str, ...]


def when(flag: str, *names: str) -> When:
    return When(flag, names)


@dataclass(frozen=True)
class Declaration:
    arguments: tuple[str, ...]  # the kernel's parameters, in order
    reads: tuple[str | When, ...]
    writes: tuple[str | When, ...]

    def resolve(self, kwargs: Mapping) -> tuple[list[str], list[str]]:
        """(read, written) names for one launch, in argument order, tensor arguments only. KeyError where a
        flag of the declaration is not among the launch's arguments."""

        def ordered(entries):
            names = set()
            for entry in entries:
                if isinstance(entry, str):
                    names.add(entry)
                elif kwargs[entry.flag]:
                    names.update(entry.names)
            return [a for a in self.arguments if a in names and _is_tensor(kwargs.get(a))]

        return ordered(self.reads), ordered(self.writes)


_declared: dict[object, Declaration] = {}  # the kernel's Python function -> its declaration


def python_function(kernel) -> object:
    # Autotuner -> JITFunction -> the Python function (each wraps the next as .fn)
    while hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


def of_this_package(kernel_idx: int) -> bool:
    """Whether the kernel that torch's kernel table holds at `kernel_idx` (the index a traced call records) is
    one of this package's."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    function = python_function(kernel_side_table.get_kernel(kernel_idx))
    return getattr(function, "__module__", "").startswith(f"{__name__.split('.')[0]}.")


def _is_tensor(value) -> bool:
    # a tensor (real, fake or functional) while tracing; Inductor's IR of one while lowering
    return isinstance(value, torch.Tensor) or type(value).__name__ == "TensorBox"


def declare_access(*, reads: tuple[str | When, ...], writes: tuple[str | When, ...]) -> Callable:
    """Decorator over a `@triton.jit` function: the tensor parameters it reads and writes (`when` entries for
    those a constexpr flag decides)."""

    def register(kernel):
        function = python_function(kernel)
        arguments = tuple(inspect.signature(function).parameters)
        for entry in (*reads, *writes):
            names = (entry,) if isinstance(entry, str) else (entry.flag, *entry.names)
            unknown = [name for name in names if name not in arguments]
            if unknown:
                raise ValueError(f"declare_access: {unknown} are not parameters of {function.__name__}")
        _declared[function] = Declaration(arguments, tuple(reads), tuple(writes))
        return kernel

    return register


def declared(kernel, kwargs: Mapping) -> tuple[list[str], list[str]] | None:
    """(read, written) argument names of one launch of a declared kernel, or None where torch must find out."""
    declaration = _declared.get(python_function(kernel))
    if declaration is None:
        return None
    configs = getattr(kernel, "configs", None)
    if configs:  # an autotuner's launch: torch analyzes the first config, whose values may be flags too
        kwargs = {**kwargs, **configs[0].kwargs}
    try:
        return declaration.resolve(kwargs)
    except KeyError:
        return None


def _accesses(reads: list[str], writes: list[str]):
    """torch 2.13's TensorAccesses, as its own analysis builds it."""
    from torch._higher_order_ops.triton_kernel_wrap import TensorAccesses
    from torch._inductor.dependencies import ReadWrites, StarDep
    from torch.utils._ordered_set import OrderedSet

    read_writes = ReadWrites(
        reads=OrderedSet(StarDep(name) for name in reads),
        writes=OrderedSet(StarDep(name) for name in writes),
        index_exprs=OrderedSet(),
    )
    return TensorAccesses(
        read_writes=read_writes, can_fuse_epilogue=len(writes) == 1 and writes[0] not in reads
    )


def _answering(torch_function: Callable, answer: str) -> Callable:
    @functools.wraps(torch_function)
    def answer_declared(kernel, kwargs, tma_descriptor_metadata, *args, **kw):
        found = None if args or kw or tma_descriptor_metadata else declared(kernel, kwargs)
        if found is None:  # through the attribute, where a benchmark may time torch's function
            stats["passed_on"] += 1
            return answer_declared.hf_switchback_original(
                kernel, kwargs, tma_descriptor_metadata, *args, **kw
            )
        stats["declared"] += 1
        reads, writes = found
        return writes if answer == "writes" else _accesses(reads, writes)

    answer_declared.hf_switchback_original = torch_function
    return answer_declared


def _torch_function():
    """(module, name, answer kind) of this torch's analysis function with the known signature, or None."""
    try:
        from torch._higher_order_ops import triton_kernel_wrap
    except ImportError:
        return None
    for name, answer in _TORCH_FUNCTIONS:
        current = getattr(triton_kernel_wrap, name, None)
        if current is None:
            continue
        original = getattr(current, "hf_switchback_original", current)
        if list(inspect.signature(original).parameters)[:3] != _SIGNATURE:
            return None
        if answer == "accesses" and not hasattr(triton_kernel_wrap, "TensorAccesses"):
            return None
        return triton_kernel_wrap, name, answer
    return None


def install() -> bool:
    """Put the declarations in front of torch's analysis (once). False where this torch has no analysis
    function of a known signature, or HF_SWITCHBACK_DECLARED_ACCESS=0."""
    if os.environ.get("HF_SWITCHBACK_DECLARED_ACCESS", "1") == "0":
        return False
    found = _torch_function()
    if found is None:
        return False
    module, name, answer = found
    current = getattr(module, name)
    if not hasattr(current, "hf_switchback_original"):
        setattr(module, name, _answering(current, answer))
    return True


def is_installed() -> bool:
    found = _torch_function()
    return found is not None and hasattr(getattr(found[0], found[1]), "hf_switchback_original")


def uninstall() -> None:
    """Restore torch's function (tests)."""
    found = _torch_function()
    if found is not None:
        module, name, _ = found
        current = getattr(module, name)
        setattr(module, name, getattr(current, "hf_switchback_original", current))
    stats.update(declared=0, passed_on=0)


def torch_analysis() -> Callable | None:
    """torch's own analysis function behind the declarations (what the tests compare them with), or None."""
    found = _torch_function()
    if found is None:
        return None
    module, name, _ = found
    current = getattr(module, name)
    return getattr(current, "hf_switchback_original", current)


__all__ = [
    "declare_access",
    "declared",
    "install",
    "is_installed",
    "of_this_package",
    "python_function",
    "torch_analysis",
    "uninstall",
    "when",
]
