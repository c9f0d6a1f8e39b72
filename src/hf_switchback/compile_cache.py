"""Let torch.compile reuse a SwitchBack model's traced graphs from its on-disk cache in a later process.

torch.compile keeps two on-disk caches: Inductor's FX graph cache (the generated kernels and code) and, in front of
it, AOT autograd's cache, which also skips tracing forward and backward again. AOT autograd refuses every graph
that holds a custom `torch.autograd.Function` unless `torch._functorch.config.
autograd_cache_allow_custom_autograd_functions` is set: torch's cautious default, since an arbitrary Function may
depend on Python state its cache key does not see. SwitchBack layers are such Functions, so by default a resumed or
repeated compiled run traces every layer again, and its first step takes much longer than with the setting
(BENCHMARKS.md, Whole training step).

Why the cache key covers SwitchBack's Functions: Dynamo traces their forward and backward into the graph it hashes
(nothing of them runs as Python afterwards); every choice they make (precision, KernelOptions, the crossover
thresholds of the current GPU) is a constant of that traced graph; and their Triton kernels run through
`torch.library.triton_op`s, whose kernel sources torch hashes into the key.

The setting is torch's and process-wide: it admits the other custom Functions of the process too. So this
module only offers it: `examples/train_clip.py --torch_compile` calls `allow_compile_cache()`, and so can a loop of
your own that compiles a SwitchBack model. TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0 in the
environment still wins (torch reads it over any value set in code).
"""

from __future__ import annotations

_SETTING = "autograd_cache_allow_custom_autograd_functions"


def allow_compile_cache() -> bool:
    """Let AOT autograd cache graphs with custom autograd Functions (SwitchBack layers) across processes.

    Returns whether torch has the setting (False on a torch without it: nothing changes, compiling still works).
    """
    import torch._functorch.config as config  # not imported by `import torch`

    if not hasattr(config, _SETTING):
        return False
    setattr(config, _SETTING, True)
    return True


__all__ = ["allow_compile_cache"]
