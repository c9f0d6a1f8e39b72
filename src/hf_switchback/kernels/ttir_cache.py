"""torch.compile's analysis of our Triton kernels, done once per kernel specialization instead of at every call.

When torch.compile traces a Triton kernel launched through `wrap_triton` (ours, kernels/library.py), it finds
which arguments the kernel writes by running Triton's front end on the kernel and walking the Triton IR (TTIR)
it returns (`torch._higher_order_ops.triton_kernel_wrap.generate_ttir`). It does so at every call of every
kernel, and again in each pass over the graph: AOT autograd's metadata pass, its joint trace, Inductor's
lowering. A cold ViT-B/16 int8 first step (per-layer compile, H100) generated TTIR 116 times, and Triton's front
end took 9.2 of its 42 s of CPU (BENCHMARKS.md, Whole training step: compile warm-up); a bf16 step runs none.

The TTIR depends only on what `generate_ttir` reads of the call: the kernel (of an Autotuner, its function with
the first config's values, as torch's function takes it), its constexpr arguments, the dtype of each tensor
argument (it replaces every fake tensor by a fresh 2-element one; of a real one Triton also reads the
alignment), the values of the other arguments (Triton specializes integers equal to 1 or divisible by 16;
symbolic sizes become 2; a Triton dtype such as tl.int8, the constexpr of an 8-bit output, is one by its name),
and the GPU. So for our kernels `install()` keeps the result per key made of those (not of Triton's
process-wide compile settings, which torch's function reads too and a compiling process does not change), and
every other call (another library's kernel, TMA descriptor arguments, an argument it cannot key) runs torch's
function unchanged. Installed by kernels/graph_leaf.py when torch.compile first traces a SwitchBack op, where
torch's function has the signature this module knows; HF_SWITCHBACK_TTIR_CACHE=0 leaves torch's function alone.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Hashable, Mapping

import torch

from .kernel_access import python_function

_PACKAGE = __name__.split(".")[0]
_SIGNATURE = ["kernel", "kwargs", "tma_descriptor_metadata"]
_SCALARS = (bool, int, str, torch.dtype)  # (floats are keyed by their bits, before these)
# above the distinct specializations of a model's graphs (tens); each entry holds an MLIR context
_MAX_ENTRIES = 256
_results: dict[Hashable, tuple] = {}
# Since install: calls answered from the cache / by torch's function for a new key, and the calls passed on to
# torch's function uncached, counted by why (what a benchmark reads to find the calls the key should cover).
stats = {"hits": 0, "misses": 0, "passed_on": {}}


def _argument_key(value) -> Hashable | None:
    """What generate_ttir reads of one argument; None when this module does not know the argument's kind."""
    if isinstance(value, float):  # by its bits: -0.0 and 0.0 inline differently, and a NaN must match itself
        return ("float", value.hex())
    if value is None or isinstance(value, _SCALARS):
        return (type(value).__name__, value)
    if isinstance(value, torch.Tensor):
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(value, FakeTensor):  # torch's function replaces it by a fresh (aligned) tensor
            return ("tensor", value.dtype)
        return ("tensor", value.dtype, value.data_ptr() % 16 == 0)  # a real one: Triton specializes alignment
    if type(value).__name__ == "dtype" and type(value).__module__.startswith("triton.language"):
        return ("triton dtype", str(value))  # a constexpr such as the 8-bit output's tl.int8: by its name
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("symbolic",)
    if type(value).__name__ == "TensorBox" and hasattr(value, "get_dtype"):  # Inductor's IR (its lowering)
        return ("tensor", value.get_dtype())
    if type(value).__module__.startswith("sympy"):
        return ("symbolic",)
    return None


def _device_key() -> Hashable:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(torch.cuda.current_device())


def call_key(kernel, kwargs: Mapping, tma_descriptor_metadata) -> Hashable | None:
    """The key of one generate_ttir call, or None where torch's function must run (not our kernel, TMA
    descriptors, an argument of an unknown kind)."""
    return _key_or_reason(kernel, kwargs, tma_descriptor_metadata)[0]


def _key_or_reason(kernel, kwargs: Mapping, tma_descriptor_metadata) -> tuple[Hashable | None, str | None]:
    """(key, None), or (None, why the call must go to torch's function)."""
    function = python_function(kernel)
    if not getattr(function, "__module__", "").startswith(f"{_PACKAGE}."):
        return None, "another library's kernel"
    if tma_descriptor_metadata:
        return None, "TMA descriptors"
    configs = getattr(kernel, "configs", None)
    if configs is not None:
        # An Autotuner (torch wraps a kernel launched with num_warps / num_stages in a new one-config autotuner
        # at each call): torch's function traces its first config's JITFunction,
        # so two autotuners of one kernel and the kernel called with that config's values share the key.
        kwargs = {**kwargs, **configs[0].kwargs} if configs else kwargs
        kernel = kernel.fn
    arguments = []
    for name in sorted(kwargs):
        value = kwargs[name]
        key = _argument_key(value)
        if key is None:
            return None, f"argument of type {type(value).__module__}.{type(value).__qualname__}"
        arguments.append((name, key))
    return (kernel, tuple(arguments), _device_key()), None  # kernels hash by identity


def _cached(generate_ttir: Callable) -> Callable:
    @functools.wraps(generate_ttir)
    def cached_generate_ttir(kernel, kwargs, tma_descriptor_metadata, *args, **kw):
        key, why = (
            (None, "extra arguments")
            if args or kw
            else _key_or_reason(kernel, kwargs, tma_descriptor_metadata)
        )
        if key is None:  # torch's function, through the attribute (where a benchmark's timer may be) as below
            stats["passed_on"][why] = stats["passed_on"].get(why, 0) + 1
            return cached_generate_ttir.hf_switchback_original(
                kernel, kwargs, tma_descriptor_metadata, *args, **kw
            )
        result = _results.get(key)
        stats["hits" if result is not None else "misses"] += 1
        if result is None:  # through the attribute: a benchmark may time torch's function behind the cache
            result = cached_generate_ttir.hf_switchback_original(kernel, kwargs, tma_descriptor_metadata)
            if len(_results) >= _MAX_ENTRIES:
                _results.clear()
            _results[key] = result
        module, names = result
        return module, list(names)  # the caller gets a list of its own, as from torch's function

    cached_generate_ttir.hf_switchback_original = generate_ttir
    return cached_generate_ttir


def install() -> bool:
    """Put the cache in front of torch's generate_ttir (once). False where this torch has no such function of
    the known signature, or HF_SWITCHBACK_TTIR_CACHE=0."""
    if os.environ.get("HF_SWITCHBACK_TTIR_CACHE", "1") == "0":
        return False
    try:
        from torch._higher_order_ops import triton_kernel_wrap
    except ImportError:
        return False
    current = getattr(triton_kernel_wrap, "generate_ttir", None)
    if current is None:
        return False
    if hasattr(current, "hf_switchback_original"):
        return True
    if list(inspect.signature(current).parameters)[:3] != _SIGNATURE:
        return False
    triton_kernel_wrap.generate_ttir = _cached(current)
    return True


def uninstall() -> None:
    """Restore torch's function (tests) and forget the cached results."""
    from torch._higher_order_ops import triton_kernel_wrap

    current = getattr(triton_kernel_wrap, "generate_ttir", None)
    if current is not None and hasattr(current, "hf_switchback_original"):
        triton_kernel_wrap.generate_ttir = current.hf_switchback_original
    _results.clear()
    stats.update(hits=0, misses=0, passed_on={})


__all__ = ["call_key", "install", "uninstall"]
