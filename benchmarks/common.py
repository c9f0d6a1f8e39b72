"""What the benchmark scripts share: row grammar, compile-time accounting, ratios, statistics, timing, versions.

Row grammar (bench_train.py, bench_memory.py, compile_warmup.py): BASE[+ckpt][+budgetF][+compile][@B]

  BASE           bf16, a SwitchBack row (int8, fp8-memeff, ...) or torchao-float8-<recipe> (bench_train.BASES)
  +ckpt          full gradient checkpointing of every encoder layer (HF gradient_checkpointing_enable)
  +budgetF       torch._functorch.config.activation_memory_budget = F (0..1) while the row compiles: Inductor's
                 partitioner recomputes (cheapest first) until at most F of the activations it would save are
                 saved (needs +compile); on a SwitchBack base it recomputes on top of the 8-bit saving
  +compile       torch.compile (the whole model unless the script is told --compile layers)
  @B             this row's batch (default: --batch, else the model's)

Compile-time accounting: torch.compile records how long each of its phases took
(`torch._dynamo.utils.compilation_time_metrics`, seconds per call, cleared by `torch._dynamo.reset()`); totals
taken before and after the first step split its wall time into

    compile_forward_s      Dynamo tracing + AOT autograd + Inductor compiling the forward graphs
    compile_backward_s     Inductor compiling the backward graphs (AOT autograd does it in the first backward)
    kernel_compile_wait_s  of those two, the time spent waiting for Inductor's parallel kernel compiles
    run_s                  the rest: running the step, which on its first call also autotunes Triton kernels

and `cache_counts` does the same for torch.compile's on-disk caches (FX graph cache, AOT autograd cache: how
many graphs hit, missed or bypassed). The metric names are torch internals; both return {} where they are
missing, and tests/test_benchmarks.py checks them on the installed torch with a real compile.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import NamedTuple

MODIFIERS = ("ckpt", "compile")


class Variant(NamedTuple):
    """One row's configuration, parsed from its spec (see the module docstring)."""

    base: str  # bf16, int8-memeff, torchao-float8-rowwise, ...
    grad_ckpt: bool  # +ckpt
    budget: float | None  # +budgetF (None: the partitioner's default, 1.0)
    compiled: bool  # +compile
    batch: int | None = None  # @B (None: --batch, or the model's default)


def parse_variant(spec: str, bases: tuple[str, ...]) -> Variant:
    """'bf16+budget0.5+compile@128' -> Variant('bf16', False, 0.5, True, 128); ValueError naming the bad part."""
    spec, at, batch_text = spec.partition("@")
    batch = None
    if at:
        if not batch_text.isdigit() or int(batch_text) <= 0:
            raise ValueError(f"{spec}@{batch_text}: @B needs a positive batch, e.g. @128")
        batch = int(batch_text)
    base, *mods = spec.split("+")
    if base not in bases:
        raise ValueError(f"unknown variant base {base!r} in {spec!r}; choose from {bases}")
    budget = None
    for mod in mods:
        if mod.startswith("budget"):
            try:
                budget = float(mod.removeprefix("budget"))
            except ValueError:
                budget = -1.0
            if not 0.0 <= budget <= 1.0:
                raise ValueError(f"{spec!r}: +budgetF needs 0 <= F <= 1, e.g. +budget0.5")
        elif mod not in MODIFIERS:
            raise ValueError(f"unknown modifier +{mod} in {spec!r}; use +ckpt, +budgetF, +compile")
    compiled = "compile" in mods
    if budget is not None and not compiled:
        raise ValueError(f"{spec!r}: +budgetF is a torch.compile setting; add +compile")
    return Variant(base, "ckpt" in mods, budget, compiled, batch)


def recompute_budget(budget: float | None):
    """Context in which torch.compile partitions the graphs under `budget` (None: the default, 1.0)."""
    if budget is None:
        return contextlib.nullcontext()
    import torch._functorch.config  # not an attribute of torch._functorch until imported

    return torch._functorch.config.patch(activation_memory_budget=budget)


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


def ratio(value: float | None, reference: float | None) -> str:
    """'1.23x' (value over reference), or '-' where either is missing."""
    return f"{value / reference:.2f}x" if value and reference else "-"


def print_header(header: str) -> None:
    print(header)
    print("-" * len(header))


def emit(rows: list[dict], env: dict, json_path: str | None) -> None:
    """Print the newest row as one JSON line and rewrite `json_path` with all rows, so a killed process keeps
    what it measured."""
    print(json.dumps(rows[-1]), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(dict(env=env, rows=rows), indent=1))


def mean_se(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and standard error of the mean (None where there are too few values)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


# Two-sided 95% Student t quantiles by degrees of freedom (pairs - 1): with a handful of pairs, +-2 SE is far
# too narrow (2 pairs: 12.7 SE).
T95 = {
    1: 12.71,
    2: 4.30,
    3: 3.18,
    4: 2.78,
    5: 2.57,
    6: 2.45,
    7: 2.36,
    8: 2.31,
    9: 2.26,
    10: 2.23,
    15: 2.13,
    20: 2.09,
}


def t95(df: int) -> float:
    """Two-sided 95% quantile of Student's t with `df` degrees of freedom (the table's next lower entry)."""
    return T95[max(k for k in T95 if k <= df)]


def do_bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Milliseconds per call of fn: triton's do_bench (warmup and rep in ms) where CUDA is, else the median of a
    few wall-clock calls after one untimed call (CPU smoke runs: a timing that only has to be positive)."""
    import torch

    if torch.cuda.is_available():
        from triton.testing import do_bench as triton_do_bench

        return triton_do_bench(fn, warmup=warmup, rep=rep)
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def versions(device: str, extra: tuple[str, ...] = ("triton", "transformers", "torchao")) -> dict:
    """torch, python, the GPU's name (CUDA) and the versions of `extra` (a missing package is reported)."""
    import torch

    env = dict(torch=torch.__version__, python=platform.python_version())
    if device == "cuda":
        env["device"] = torch.cuda.get_device_name()
    for module in extra:
        try:
            env[module] = __import__(module).__version__
        except Exception as err:  # a missing optional package is reported, not fatal
            env[module] = f"unavailable ({type(err).__name__})"
    return env
