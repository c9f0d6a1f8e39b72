"""Where a first training step's time goes: compiling graphs, or running the step.

torch.compile records how long each of its phases took (`torch._dynamo.utils.compilation_time_metrics`,
seconds per call, cleared by `torch._dynamo.reset()`). Taking the totals before and after the first step splits
its wall time into

    compile_forward_s      Dynamo tracing + AOT autograd + Inductor compiling the forward graphs
    compile_backward_s     Inductor compiling the backward graphs (AOT autograd does it in the first backward)
    kernel_compile_wait_s  of those two, the time spent waiting for Inductor's parallel kernel compiles
    run_s                  the rest: running the step, which on its first call also autotunes Triton kernels
                           (Inductor's and user-defined ones benchmark their configs at the first launch) and
                           JIT-compiles kernels launched outside Inductor's code

`cache_counts` does the same for torch.compile's on-disk caches (Inductor's FX graph cache, AOT autograd's
cache): how many graphs of the first step were loaded (hit), compiled and stored (miss), or could not be cached
at all (bypass), which tells a warm start that recompiles apart from one that runs slowly.

The metric names are torch internals; `phase_totals` returns {} where they are missing, and
tests/test_benchmarks.py checks them on the installed torch with a real compile.
"""

from __future__ import annotations

# (our name, the torch.compile timer it sums)
PHASES = (
    ("compile_forward_s", "_compile.compile_inner"),
    ("compile_backward_s", "backward._backward_impl"),
    ("kernel_compile_wait_s", "async_compile.wait"),
)

# (our name, torch._dynamo.utils.counters group, counter)
CACHE_COUNTERS = tuple(
    (f"{short}_{outcome}", group, f"{prefix}_{outcome}")
    for short, group, prefix in (
        ("fx_graph", "inductor", "fxgraph_cache"),
        ("aot_autograd", "aot_autograd", "autograd_cache"),
    )
    for outcome in ("hit", "miss", "bypass")
)


def phase_totals() -> dict[str, float]:
    """Seconds spent so far in each phase of PHASES, summed over calls ({} without the metrics)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return {name: float(sum(compilation_time_metrics.get(key, ()))) for name, key in PHASES}


def first_step_split(
    before: dict[str, float], after: dict[str, float], first_step_s: float
) -> dict[str, float]:
    """The first step's seconds by phase, from `phase_totals()` taken before and after it."""
    if not before or not after:
        return {}
    split = {name: round(after[name] - before[name], 3) for name, _ in PHASES}
    split["run_s"] = round(first_step_s - split["compile_forward_s"] - split["compile_backward_s"], 3)
    return split


def cache_counts() -> dict[str, int]:
    """How many graphs so far hit, missed or bypassed each of torch.compile's caches ({} without counters)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {name: int(counters[group][key]) for name, group, key in CACHE_COUNTERS}


def first_step_caches(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The first step's cache outcomes, from `cache_counts()` taken before and after it."""
    if not before or not after:
        return {}
    return {name: after[name] - before[name] for name, _, _ in CACHE_COUNTERS}
