"""What the benchmark scripts share: row grammar, compile cache counts, time budget, tables, statistics.

Row grammar (bench_train.py, bench_memory.py, compile_warmup.py): BASE[+ckpt][+budgetF][+compile][@B]
  +ckpt      full gradient checkpointing of every encoder layer
  +budgetF   torch._functorch.config.activation_memory_budget = F (0..1) while the row compiles: Inductor's
             partitioner recomputes until at most F of the activations are saved (needs +compile)
  +compile   torch.compile (the whole model, or each encoder layer with --compile layers)
  @B         this row's batch

Compile caches: torch.compile's counters, read before and after the first step, give its FX graph and AOT
autograd cache hits, misses and bypasses. The names are torch internals: {} where missing; the tests check them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple


class Variant(NamedTuple):
    """One row's configuration, parsed from its spec (see the module docstring)."""

    base: str  # bf16, int8-memeff, torchao-float8-rowwise, ...
    grad_ckpt: bool
    budget: float | None  # None: the partitioner's default, 1.0
    compiled: bool
    batch: int | None = None  # None: --batch, or the model's default


def parse_variant(spec: str, is_base, bases_help: str) -> Variant:
    """'bf16+budget0.5+compile@128' -> Variant('bf16', False, 0.5, True, 128); ValueError naming the bad part."""
    spec, at, batch_text = spec.partition("@")
    if at and (not batch_text.isdigit() or int(batch_text) <= 0):
        raise ValueError(f"{spec}@{batch_text}: @B needs a positive batch, e.g. @128")
    base, *mods = spec.split("+")
    if not is_base(base):
        raise ValueError(f"unknown variant base {base!r} in {spec!r}; choose from {bases_help}")
    budget = None
    for mod in mods:
        if mod.startswith("budget"):
            with contextlib.suppress(ValueError):
                budget = float(mod.removeprefix("budget"))
            if budget is None or not 0.0 <= budget <= 1.0:
                raise ValueError(f"{spec!r}: +budgetF needs 0 <= F <= 1, e.g. +budget0.5")
        elif mod not in ("ckpt", "compile"):
            raise ValueError(f"unknown modifier +{mod} in {spec!r}; use +ckpt, +budgetF, +compile")
    if budget is not None and "compile" not in mods:
        raise ValueError(f"{spec!r}: +budgetF is a torch.compile setting; add +compile")
    return Variant(base, "ckpt" in mods, budget, "compile" in mods, int(batch_text) if at else None)


def recompute_budget(budget: float | None):
    """Context in which torch.compile partitions the graphs under `budget` (None: the default, 1.0)."""
    if budget is None:
        return contextlib.nullcontext()
    import torch._functorch.config  # not an attribute of torch._functorch until imported

    return torch._functorch.config.patch(activation_memory_budget=budget)


# (our name, torch._dynamo.utils.counters group, counter)
CACHE_COUNTERS = tuple(
    (f"{short}_{outcome}", group, f"{prefix}_{outcome}")
    for short, group, prefix in (("fx_graph", "inductor", "fxgraph_cache"), ("aot_autograd", "aot_autograd", "autograd_cache"))
    for outcome in ("hit", "miss", "bypass")
)  # fmt: skip


def cache_counts() -> dict[str, int]:
    """How many graphs so far hit, missed or bypassed each of torch.compile's caches ({} without counters)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {name: int(counters[group][key]) for name, group, key in CACHE_COUNTERS}


def compile_phase_seconds() -> dict[str, float]:
    """Seconds so far in each of torch.compile's timed phases (Dynamo, AOT autograd, Inductor lowering, code
    generation, module loading, ...), summed over calls; {} where torch keeps no such timers."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return {name: round(sum(times), 3) for name, times in compilation_time_metrics.items()}


def compiles_so_far() -> list:
    """torch's metrics record of each graph compiled so far (Dynamo's forward, AOT's lazy backward); [] where
    this torch keeps none. Pass it to kernel_compiles_since after the step to read that step's graphs."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:
        return []
    return get_compilation_metrics()


def kernel_compiles_since(before: list) -> list[dict]:
    """Per graph compiled since `before` (compiles_so_far()): its compile id, whether it is a forward, and the
    Triton kernels Inductor compiled for it, slowest first, as [name, seconds]: each kernel's compile time in
    its worker (torch keeps the 25 slowest per graph). Kernels compile in parallel, so the slowest is the
    least the graph waits, and their sum is the CPU time, not the wall time."""
    seen = {id(m) for m in before}
    graphs = []
    for metrics in compiles_so_far():
        times = getattr(metrics, "triton_kernel_compile_times_us", None)
        if id(metrics) in seen or not times:
            continue
        try:
            kernels = [[str(name), round(us / 1e6, 3)] for name, us in json.loads(times)]
        except (TypeError, ValueError):
            continue  # torch's "<unknown>" for a record it could not write
        forward = getattr(metrics, "is_forward", None)
        graphs.append(dict(graph=str(getattr(metrics, "compile_id", "")), forward=forward, kernels=kernels))
    return graphs


@contextlib.contextmanager
def ttir_generation():
    """Count and time torch.compile's TTIR generations of Triton kernels inside (kernels/ttir_cache.py says what
    they are): the calls that reach torch's function, behind our kernels' declared accesses
    (kernels/kernel_access.py) and our cache where they are on. Yields the record {"calls", "s", "passed_on",
    "declared"} (passed_on: the calls among them the cache did not key, by why; declared: the analyses the
    declarations answered, with no TTIR); empty where this torch has no such function."""
    record = {"calls": 0, "s": 0.0}
    try:
        from torch._higher_order_ops import triton_kernel_wrap

        from hf_switchback.kernels import kernel_access, ttir_cache
    except ImportError:
        yield {}
        return
    kernel_access.install()  # as the first trace would (each a no-op where switched off)
    ttir_cache.install()
    current = getattr(triton_kernel_wrap, "generate_ttir", None)
    if current is None:
        yield {}
        return
    owner, name = (
        (current, "hf_switchback_original")
        if hasattr(current, "hf_switchback_original")
        else (triton_kernel_wrap, "generate_ttir")
    )
    torch_function = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return torch_function(*args, **kwargs)
        finally:
            record["calls"] += 1
            record["s"] += time.perf_counter() - start

    setattr(owner, name, timed)
    passed_on_before = dict(ttir_cache.stats["passed_on"])
    declared_before = kernel_access.stats["declared"]
    try:
        yield record
    finally:
        setattr(owner, name, torch_function)
        record["s"] = round(record["s"], 3)
        record["declared"] = kernel_access.stats["declared"] - declared_before
        passed_on = ttir_cache.stats["passed_on"]
        record["passed_on"] = {
            why: n - passed_on_before.get(why, 0)
            for why, n in passed_on.items()
            if n > passed_on_before.get(why, 0)
        }


@contextlib.contextmanager
def python_profile(path: Path | None, top: int = 60):
    """cProfile what runs inside, where `path` is given: the stats file at `path` and, beside it, the `top`
    functions by cumulative and by own time as text (path + '.txt'). Nothing without a path."""
    if path is None:
        yield
        return
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(path))
        text = io.StringIO()
        for order in ("cumulative", "tottime"):
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
        Path(f"{path}.txt").write_text(text.getvalue())


def first_step_caches(before: dict, after: dict) -> dict[str, int]:
    """The first step's cache outcomes, from `cache_counts()` taken before and after it."""
    if not before or not after:
        return {}
    return {name: after[name] - before[name] for name, _, _ in CACHE_COUNTERS}


class Clock:
    """--time_budget_s: a run starts only if the longest run so far of the same key would still end in time."""

    def __init__(self, budget_s: float | None):
        self.start, self.budget_s, self.longest = time.perf_counter(), budget_s, {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, key) -> bool:
        return not self.budget_s or self.elapsed() + self.longest.get(key, 0.0) <= self.budget_s

    def record(self, key, seconds: float) -> None:
        self.longest[key] = max(self.longest.get(key, 0.0), seconds)


def ratio(value: float | None, reference: float | None) -> str:
    """'1.23x' (value over reference), or '-' where either is missing."""
    return f"{value / reference:.2f}x" if value and reference else "-"


def print_table(rows: list[dict], lead: list[tuple[str, str, int]], cols: list[tuple], measured: str) -> None:
    """One line per row: `lead` cells (title, key, width), then `cols` (title, row -> value, format spec) for
    rows that have `measured`, else the row's status and error."""
    cols = [(title, get, spec, max(len(title), 7)) for title, get, spec in cols]
    header = " ".join([*(f"{t:{w}}" for t, _, w in lead), *(f"{t:>{w}}" for t, _, _, w in cols)])
    print(header + "\n" + "-" * len(header))
    for r in rows:
        cells = [f"{r.get(key)!s:{w}}" for _, key, w in lead]
        if measured not in r:
            print(*cells, f"{r.get('status', 'error')}: {r.get('error', '')[:120]}")
            continue
        values = [(get(r), spec, w) for _, get, spec, w in cols]
        print(*cells, *(f"{'-' if v is None else format(v, s):>{w}}" for v, s, w in values))


@contextlib.contextmanager
def gpu_clocks(enabled: bool, gpu: str | None = None, interval_ms: int = 100):
    """Sample the GPU's SM clock (MHz) and board power (W) with nvidia-smi while the block runs; the yielded
    dict gets their medians and the sample count when it ends ({} where disabled or nvidia-smi is missing).
    A step that holds the board at its power limit runs at a lower clock: the sustained step's time depends
    on the energy its kernels take, which a profile of kernel times alone does not show. gpu: nvidia-smi's
    -i (default: the current device, through CUDA_VISIBLE_DEVICES)."""
    found: dict = {}
    if not enabled or shutil.which("nvidia-smi") is None:
        yield found
        return
    gpu = gpu if gpu is not None else _nvidia_smi_index()
    query = ["nvidia-smi", "-i", gpu, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
    sampler = subprocess.Popen(
        [*query, f"-lms={interval_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        yield found
    finally:
        sampler.terminate()
        try:
            out, _ = sampler.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # it ignored the terminate: its samples are not worth a hang
            sampler.kill()
            out, _ = sampler.communicate()
        samples = []
        for line in out.splitlines():
            with contextlib.suppress(ValueError):
                clock, power = (float(v) for v in line.split(","))
                samples.append((clock, power))
        if samples:
            found.update(
                sm_clock_mhz=statistics.median(c for c, _ in samples),
                power_w=statistics.median(w for _, w in samples),
                clock_samples=len(samples),
            )


def _nvidia_smi_index() -> str:
    import torch

    index = torch.cuda.current_device()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


def write_json(path: Path, value, indent: int | None = None) -> None:
    """Write JSON through a temporary file: a reader polling for the file never sees it half written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=indent) + "\n")
    tmp.replace(path)


def emit(rows: list[dict], env: dict, json_path: str | None) -> None:
    """Print the newest row as one JSON line and rewrite `json_path` with all rows (a killed process keeps
    what it measured)."""
    print(json.dumps(rows[-1]), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(dict(env=env, rows=rows), indent=1))


def row_in_process(
    argv: list[str], json_path: Path, env: dict | None = None, timeout: float | None = None
) -> dict:
    """Run a benchmark script (argv: the script and its flags, which must make it write its rows to json_path)
    in a fresh Python process: its first row, or a row with status "error" saying why there is none."""
    try:
        proc = subprocess.run(
            [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return dict(status="error", error=f"timed out after {timeout} s")
    if proc.returncode != 0 or not json_path.exists():
        return dict(status="error", error=f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return json.loads(json_path.read_text())["rows"][0]


def without_flags(argv: list[str], flags: set[str]) -> list[str]:
    """argv without each option in `flags` (as --flag or --flag=value) and the values that follow it."""
    kept, dropping = [], False
    for token in argv:
        if token.startswith("-"):
            dropping = token.split("=", 1)[0] in flags
        if not dropping:
            kept.append(token)
    return kept


def parser_of(doc: str, **kwargs) -> argparse.ArgumentParser:
    """A script's parser: its module docstring as the description, line breaks kept."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs
    )


def add_smoke_flags(parser, what: str = "smoke test only") -> None:
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=f"cpu: {what}")
    parser.add_argument("--tiny", action="store_true", help="CPU-test-size shapes (smoke test)")


def check_device(parser, args) -> None:
    """A CUDA run needs a GPU; a CPU run is a smoke test and needs --tiny."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU; use --device cpu --tiny for a smoke run")
    if args.device == "cpu" and not args.tiny:
        parser.error("--device cpu says nothing about the GPU at real sizes: add --tiny (a smoke test)")


def mean_se(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and standard error of the mean (None where there are too few values)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


# Two-sided 95% Student t quantiles by degrees of freedom: with a handful of pairs +-2 SE is far too narrow.
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13, 20: 2.09}  # fmt: skip


def t95(df: int) -> float:
    """Two-sided 95% quantile of Student's t with `df` degrees of freedom (the table's next lower entry)."""
    return T95[max(k for k in T95 if k <= df)]


def do_bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Milliseconds per call of fn: triton's do_bench (warmup and rep in ms) on CUDA, else the median of three
    wall-clock calls after an untimed one (CPU smoke runs: a timing that only has to be positive)."""
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
