"""Let torch.compile reuse a SwitchBack model's traced graphs in a later process, on this machine or another.

torch.compile keeps two on-disk caches: Inductor's FX graph cache (the generated kernels and code) and, in front of
it, AOT autograd's cache, which also skips tracing forward and backward again. A SwitchBack op reaches Dynamo's
graph as one call of a graph leaf (kernels/graph_leaf.py), which that module marks cacheable under a key of the
package's files, so both caches take SwitchBack graphs with torch's default settings; a new release of the
package, or an edited kernel, misses the old entries.

What a warm start still pays is the process's own work: Dynamo's trace (not cached by torch) and loading the
cached kernels. Inductor loads its own kernels with torch's static CUDA launcher, from the cubins its cache
holds; user-defined Triton kernels, ours among them, go through Triton's compile path again per kernel and
config (its on-disk cache hits, but the Python around it took 1.1-3.3 s of a 5-8 s warm ViT-B/16 start) unless
`torch._inductor.config.static_launch_user_defined_triton_kernels` is set, in this process and in the
environment of Inductor's compile workers, which decide it for the kernels they compile (BENCHMARKS.md, Whole
training step: compile warm-up). `allow_compile_cache()` sets both (and, with CUDA, starts Inductor's compile
workers at once: `start_compile_workers`), and AOT autograd's
`autograd_cache_allow_custom_autograd_functions`, which custom autograd Functions still traced by Dynamo need
(torch's cautious default refuses them: an arbitrary Function may depend on Python state its cache key does not
see). Both settings are torch's and process-wide, so this module only offers them:
`examples/train_clip.py --torch_compile` calls `allow_compile_cache()`, and so can a loop of your own that
compiles a SwitchBack model. The environment variables TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0
and TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=0 still win (torch reads them over any value set
in code).

Both caches live on one machine (TORCHINDUCTOR_CACHE_DIR, by default under /tmp), so a new node, a fresh
container or a CI job starts cold. `save_compile_artifacts(path)` writes everything this process's compiles
produced or loaded (torch.compiler.save_cache_artifacts: Inductor's graphs with their Triton kernels, AOT
autograd's entries, Inductor's autotuning results) to one file; `load_compile_artifacts(path)` on any rank of the
next run, before it compiles, puts them back into that machine's caches. torch >= 2.7 has the API; a file written
by another torch version loads but its entries miss (torch keys them by its own version), so the file name
carries the version (`artifacts_file`). `examples/train_clip.py --torch_compile` does this in
<output_dir>/compile_cache (--compile_cache_dir).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

logger = logging.getLogger(__name__)

_SETTING = "autograd_cache_allow_custom_autograd_functions"
_STATIC_LAUNCH = "static_launch_user_defined_triton_kernels"
_STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def allow_compile_cache(start_workers: bool = True) -> bool:
    """Settings for a fast warm start of compiled SwitchBack models (see the module docstring): AOT autograd's
    cache takes graphs with custom autograd Functions, Inductor launches user-defined Triton kernels from its
    cached cubins. Call it before the process's first torch.compile, best before the model loads: Inductor's
    compile workers inherit the environment set here.

    start_workers (with CUDA): start those workers now (start_compile_workers says why), not at the first compile.

    Returns whether torch has the AOT autograd setting (False on a torch without it: nothing changes, compiling
    still works).
    """
    import torch._functorch.config as config  # not imported by `import torch`
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, _STATIC_LAUNCH):
        setattr(inductor_config, _STATIC_LAUNCH, True)
        # Inductor's compile workers decide how a kernel is launched, and they read this setting from their
        # environment, not from this process (torch hands them a few settings, not this one): without the
        # variable the cold run's cached kernels are not statically launchable, and a warm start compiles ours
        # again. Set before the workers start (below, or at the first compile); a value the user set stays.
        os.environ.setdefault(_STATIC_LAUNCH_ENV, "1")
    if start_workers:
        start_compile_workers()
    if not hasattr(config, _SETTING):
        return False
    setattr(config, _SETTING, True)
    return True


def start_compile_workers() -> bool:
    """Start Inductor's pool of compile worker processes now (CUDA only); returns whether it was asked to.

    torch starts the pool when Inductor is first called, once Dynamo has traced the first graph, and the workers
    take seconds to import torch and Triton. Until one answers, Inductor compiles each kernel in this process,
    one after another (`async_compile.precompile`): 2.2-6.7 s of a cold first step at ViT-B/16 to SigLIP B/16,
    more for SwitchBack's first graph, which holds more kernels (BENCHMARKS.md, compile warm-up). Started while
    the model and the data load, the pool is usually ready when the first graph's kernels are; where the model
    builds in a second or two (the benchmark's rows) it still lost that race in 10 of 26 cold starts, and those
    compiled 0.4-2.6 s in this process. torch's own switch,
    TORCH_WARM_POOL=0, still turns the early pool off (its function honours it).
    """
    if not torch.cuda.is_available():
        return False  # the pool compiles Triton kernels for GPUs; a CPU run never needs it
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without the function: its first compile starts the pool
        return False
    maybe_warm_pool()
    return True


def artifacts_file(directory: str) -> str:
    """The file in `directory` for this torch version's artifacts (entries of another version would all miss)."""
    version = torch.__version__.replace("+", "_")
    return os.path.join(directory, f"torch_compile_artifacts_torch{version}.bin")


def save_compile_artifacts(path: str) -> dict[str, int] | None:
    """Write the cache artifacts of every torch.compile so far in this process to `path`, replacing it at once
    (a temporary file renamed over it: a reader never sees half a file, and concurrent writers do not mix).

    Call it once per process, after the compiled steps have run once (forward and backward both compile on first
    use): the bytes of a second call hold everything, but torch's loader reads back only what that call added
    (torch 2.13), so a later save would replace a complete file by a partial one. Returns the number of
    artifacts per cache ({"inductor": 4, "aot_autograd": 2, ...}), logging one line of it; None when there was
    nothing to write, torch has no such API, or writing failed (a warning says why; the run goes on: it is only
    a cache).
    """
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    if save is None:
        logger.warning("torch %s cannot save compile artifacts (needs torch >= 2.7)", torch.__version__)
        return None
    try:
        saved = save()
    except Exception as err:  # a cache must never stop a run (torch catches most of its own failures here)
        logger.warning(
            "could not serialize the compile artifacts (%s: %s): the next run compiles cold",
            type(err).__name__,
            err,
        )
        return None
    if saved is None:
        return None
    data, info = saved
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except OSError as err:
        logger.warning(
            "could not write the compile artifacts to %s (%s): the next run compiles cold", path, err
        )
        if os.path.exists(temporary):
            os.remove(temporary)
        return None
    counts = _counts(info)
    logger.info("saved compile artifacts (%s) to %s", _describe(counts), path)
    return counts


def load_compile_artifacts(path: str) -> dict[str, int] | None:
    """Put the artifacts a `save_compile_artifacts(path)` wrote into this machine's torch.compile caches, so
    that the compiles that follow find their graphs there. Call it before the first compile, on every process.

    Returns the number of artifacts per cache, logging one line of it; None when the file does not exist (a first
    run) or cannot be used: a corrupt or truncated file, one of an incompatible torch, or a torch without the API
    is warned about and ignored (compiling then starts cold, as without the file)."""
    if not os.path.isfile(path):
        return None
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if load is None:
        logger.warning(
            "torch %s cannot load compile artifacts (needs torch >= 2.7): %s ignored", torch.__version__, path
        )
        return None
    # torch logs its own traceback for an unreadable file; one line of ours says what happens instead.
    torch_logger = logging.getLogger("torch.compiler._cache")
    level = torch_logger.level
    torch_logger.setLevel(logging.ERROR)
    try:
        with open(path, "rb") as f:
            info = load(f.read())
    except Exception as err:  # torch raises many kinds here across versions; a cache must never stop a run
        info, reason = None, f"{type(err).__name__}: {err}"
    else:
        reason = "corrupt, truncated, or written by an incompatible torch"
    finally:
        torch_logger.setLevel(level)
    if info is None:
        logger.warning("compile artifacts %s not loaded (%s): ignored, compiling from scratch", path, reason)
        return None
    counts = _counts(info)
    logger.info("loaded compile artifacts (%s) from %s", _describe(counts), path)
    return counts


def _counts(info) -> dict[str, int]:
    # torch >= 2.8: info.artifacts, {cache: keys}; torch 2.7: one field per cache (inductor_artifacts, ...)
    by_cache = getattr(info, "artifacts", None)
    if by_cache is None:
        by_cache = {
            f.name.removesuffix("_artifacts"): getattr(info, f.name) for f in dataclasses.fields(info)
        }
    return {cache: len(keys) for cache, keys in by_cache.items() if keys}


def _describe(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "none"


__all__ = [
    "allow_compile_cache",
    "artifacts_file",
    "load_compile_artifacts",
    "save_compile_artifacts",
    "start_compile_workers",
]
