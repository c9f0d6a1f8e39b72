"""Where a training step's GPU time goes: kernel time by family and phase (forward / backward), torch.profiler.

bench_train.py and bench_memory.py --profile run this on their rows. Each phase runs in a record_function range
that ends with a synchronize, so a kernel's phase is the range its start time falls in. Families: the first rule
of NAME_RULES that matches a kernel's name, except that kernels launched by 8-bit aten ops (cuBLAS fp8 / int8,
named like bf16 ones) are 8-bit GEMMs and Inductor kernels that absmax, round, clamp or only cast are quantizes
(a cast Inductor fused into other pointwise work counts as norm + elementwise).
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import host_waits
import torch

FORWARD, BACKWARD, OUTSIDE = "forward", "backward", "outside"
MARK = "step_profile:"
FREE = "free"  # the mark of the step run without phase synchronizes, whose GPU idle time is measured
SYNCHRONIZING_CALL = "called a synchronizing CUDA operation"  # torch's sync debug mode warning
TOP_KERNELS, TOP_GAPS = 40, 12
GEMM_16BIT, GEMM_8BIT, QUANT = "16-bit GEMM", "8-bit GEMM", "quantize/cast"
ATTENTION, ELEMENTWISE, OPTIMIZER, OTHER = "attention", "norm + elementwise", "optimizer", "other"
FAMILIES = (GEMM_16BIT, GEMM_8BIT, QUANT, ATTENTION, ELEMENTWISE, OPTIMIZER, OTHER)
# (family, lower-case name fragments), in order; GEMM_8BIT also takes every kernel an 8-bit aten op launched
NAME_RULES = (
    (GEMM_8BIT, ("_scaled_mm", "scaled_matmul", "e4m3", "e5m2", "_int_mm")),
    (QUANT, ("quantize", "_rowwise", "colsum", "absmax", "_act_backward", "direct_copy")),
    (ATTENTION, ("flash", "fmha", "attention", "sdpa")),
    (OPTIMIZER, ("multi_tensor", "adam", "foreach")),
    (GEMM_16BIT, ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk", "wgrad", "dgrad")),
    (OTHER, ("fill", "memcpy", "memset")),
    (ELEMENTWISE, ("triton_", "elementwise", "norm", "reduce", "softmax", "gelu", "clamp")),
)
EIGHT_BIT_OPS = ("aten::_scaled_mm", "aten::_int_mm", "hf_switchback::scaled_matmul")
# Inductor-generated kernels (named triton_<kind>_fused_<aten ops>_<n>) that quantize: absmax, rounding, clamping
INDUCTOR_QUANT = ("amax", "round", "clamp")
INDUCTOR_CAST = re.compile(r"triton_\w+?_fused__to_copy_\d+")  # a kernel whose only op is a dtype cast
# the CPU's GEMM ops, which stand in for kernels when a CPU run is profiled (the smoke test)
CPU_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


class Kernel(NamedTuple):
    """One kernel run: its name, the phase that launched it, its time in ms, its start on the GPU (us)."""

    name: str
    phase: str
    ms: float
    start_us: float = 0.0


def family(name: str, eight_bit: frozenset[str] = frozenset()) -> str:
    """The family of kernel `name`; `eight_bit` holds the names of kernels that 8-bit aten ops launched."""
    if name in eight_bit:
        return GEMM_8BIT
    if name in CPU_GEMM_OPS:
        return GEMM_16BIT
    lowered = name.lower()
    if lowered.startswith("triton_") and (
        any(op in lowered for op in INDUCTOR_QUANT) or INDUCTOR_CAST.fullmatch(lowered)
    ):
        return QUANT
    for fam, fragments in NAME_RULES:
        if any(fragment in lowered for fragment in fragments):
            return fam
    return OTHER


def summarize(kernels: list[Kernel], steps: int, eight_bit: frozenset[str] = frozenset()) -> dict:
    """Per step: ms and calls by family x phase, and the GPU busy time."""
    phases = lambda: dict.fromkeys((FORWARD, BACKWARD, OUTSIDE), 0.0)  # noqa: E731
    by, calls = {fam: phases() for fam in FAMILIES}, {fam: phases() for fam in FAMILIES}
    for k in kernels:
        fam = family(k.name, eight_bit)
        by[fam][k.phase] += k.ms / steps
        calls[fam][k.phase] += 1 / steps
    gpu_ms = sum(ms for phases in by.values() for ms in phases.values())
    return dict(gpu_ms_per_step=gpu_ms, ms=by, calls_per_step=calls)


def phase_of(start_us: float, ranges: list[tuple[float, float, str]]) -> str:
    for lo, hi, phase in ranges:
        if lo <= start_us <= hi:
            return phase
    return OUTSIDE


def collect(prof, device_type=None) -> tuple[list[Kernel], frozenset[str]]:
    """The kernels of a finished profile (device_type: DeviceType.CUDA by default; CPU for tests, where CPU ops
    stand in for kernels) with their phases, and the names of the kernels that 8-bit aten ops launched."""
    from torch.autograd import DeviceType

    device_type = DeviceType.CUDA if device_type is None else device_type
    events = prof.events()
    ranges = [
        (e.time_range.start, e.time_range.end, e.name.removeprefix(MARK))
        for e in events
        if e.name.startswith(MARK)
    ]
    eight_bit = frozenset(
        k.name for e in events if e.name in EIGHT_BIT_OPS for k in getattr(e, "kernels", ())
    )
    kernels = [
        Kernel(
            e.name, phase_of(e.time_range.start, ranges), e.time_range.elapsed_us() / 1000, e.time_range.start
        )
        for e in events
        # record_function ranges (Inductor's "## Call CompiledFxGraph ##", the phase marks) also appear on the
        # GPU's timeline as user annotations spanning kernels: not kernels themselves
        if e.device_type == device_type and not e.is_user_annotation and not e.name.startswith(MARK)
    ]
    return kernels, eight_bit


def top_kernels(kernels: list[Kernel], steps: int, eight_bit: frozenset[str] = frozenset()) -> list[dict]:
    """The TOP_KERNELS kernels (by name and phase) that take the most time per step, largest first."""
    by: dict[tuple[str, str], list[float]] = {}
    for k in kernels:
        entry = by.setdefault((k.name, k.phase), [0.0, 0.0])
        entry[0], entry[1] = entry[0] + k.ms / steps, entry[1] + 1 / steps
    ranked = sorted(by.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return [
        dict(name=name[:160], family=family(name, eight_bit), phase=phase, ms=ms, calls=calls)
        for (name, phase), (ms, calls) in ranked
    ]


def idle_time(kernels: list[Kernel]) -> dict:
    """GPU idle time of one step run without synchronizes (the kernels of that step, in any order): span from
    the first kernel's start to the last one's end, busy (union of kernel intervals), idle, the idle time by gap
    size, and the TOP_GAPS largest gaps with the kernels on either side (where in the step the GPU waited)."""
    if not kernels:
        return {}
    ordered = sorted(kernels, key=lambda k: k.start_us)
    first, busy_us, end_us, gaps = ordered[0].start_us, 0.0, ordered[0].start_us, []
    previous = ordered[0].name
    for k in ordered:
        k_end = k.start_us + k.ms * 1000
        if k.start_us > end_us:
            gaps.append((k.start_us - end_us, previous, k.name, end_us - first))
        busy_us += max(0.0, k_end - max(k.start_us, end_us))
        if k_end >= end_us:
            end_us, previous = k_end, k.name
    span_us = end_us - first
    buckets = {"< 10 us": (0, 10), "10-100 us": (10, 100), "0.1-1 ms": (100, 1000), ">= 1 ms": (1000, 1e18)}
    by_size = {
        label: dict(
            gaps=sum(lo <= g[0] < hi for g in gaps), ms=sum(g[0] for g in gaps if lo <= g[0] < hi) / 1000
        )
        for label, (lo, hi) in buckets.items()
    }
    largest = sorted(gaps, key=lambda g: -g[0])[:TOP_GAPS]
    return dict(
        span_ms=span_us / 1000,
        busy_ms=busy_us / 1000,
        idle_ms=(span_us - busy_us) / 1000,
        idle_by_gap_size=by_size,
        largest_gaps=[
            dict(ms=g / 1000, at_ms=at / 1000, before=before[:100], after=after[:100])
            for g, before, after, at in largest
        ],
    )


def profile(
    forward, finish, steps: int, device: str
) -> tuple[list[Kernel], frozenset[str], float, list[Kernel], dict]:
    """Run `steps` training steps (forward() -> loss, finish(loss)) under torch.profiler, phases marked, then
    one more step without synchronizes inside it; returns the marked steps' kernels, the 8-bit GEMM kernel
    names, the profiled wall ms per marked step (synchronizes and the profiler slow it: read it as a bound, not
    a figure), the kernels of the free-running step and what made the host wait in it (the synchronizing CUDA
    calls and host_waits.host_waits of its Chrome trace; CUDA runs only)."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            with record_function(MARK + FORWARD):
                loss = forward()
                sync()
            with record_function(MARK + BACKWARD):
                finish(loss)
                sync()
        wall_ms = (time.perf_counter() - t0) * 1000 / steps
        with record_function(MARK + FREE), _synchronizing_calls(device) as syncs:
            finish(forward())
        sync()
    device_type = None if device == "cuda" else torch.autograd.DeviceType.CPU
    kernels, eight_bit = collect(prof, device_type)
    # the earliest: the range's CPU side (its GPU-side annotation, if any, starts at its first kernel)
    free_start = min(
        (e.time_range.start for e in prof.events() if e.name == MARK + FREE), default=float("inf")
    )
    marked = [k for k in kernels if k.start_us < free_start]
    free = [k for k in kernels if k.start_us >= free_start]
    return (
        marked,
        eight_bit,
        wall_ms,
        free,
        dict(synchronizing_calls=syncs, **_free_step_host_waits(prof, device)),
    )


@contextlib.contextmanager
def _synchronizing_calls(device: str):
    """Yield a list that gets the distinct warnings of the CUDA calls inside the block that made the host wait
    for the GPU (torch's sync debug mode), then their count: a free-running step should have none, as each
    one drains the GPU's queue. Nothing on the CPU."""
    found: list[str] = []
    if device != "cuda":
        yield found
        return
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (the mode's own notice, that it is a prototype, is not such a call)
    messages = [str(w.message)[:200] for w in records if SYNCHRONIZING_CALL in str(w.message)]
    found.extend(sorted(set(messages))[: host_waits.TOP])
    found.append(f"{len(messages)} calls")


def _free_step_host_waits(prof, device: str) -> dict:
    """host_waits.host_waits of the free step, from the profile's Chrome trace (CUDA runs only)."""
    if device != "cuda":
        return {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    marks = [
        e["ts"]
        for e in trace.get("traceEvents", ())
        if e.get("name") == MARK + FREE and e.get("cat") == "user_annotation"
    ]
    return dict(host_waits=host_waits.host_waits(trace, after_us=min(marks))) if marks else {}


def profile_row(forward, finish, steps: int, device: str, path: Path, title: str) -> dict:
    """Profile `steps` steps, write the summary to `path` (JSON) and return it (for the row's JSON); the JSON
    also lists the top kernels and the GPU idle time of a free-running step."""
    kernels, eight_bit, wall_ms, free, host = profile(forward, finish, steps, device)
    summary = summarize(kernels, steps, eight_bit)
    summary.update(profiled_wall_ms_per_step=wall_ms, report=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    details = dict(
        top_kernels=top_kernels(kernels, steps, eight_bit), free_step=dict(idle_time(free), **host)
    )
    path.write_text(json.dumps(dict(title=title, **summary, **details), indent=1))
    return summary


def print_profiles(rows: list[dict]) -> None:
    """GPU ms per step by kernel family (forward + backward) of the rows that carry a profile (--profile)."""
    profiled = [r for r in rows if "profile" in r]
    if not profiled:
        return
    print(
        f"\n{'GPU ms/step':50} " + " ".join(f"{f[:12]:>12}" for f in FAMILIES) + f" {'busy':>7} {'wall':>7}"
    )
    for r in profiled:
        prof = r["profile"]
        cells = " ".join(f"{sum(prof['ms'][f].values()):12.1f}" for f in FAMILIES)
        print(
            f"{r['model'] + ' ' + r['variant']:44} {r['batch']:5} {cells} {prof['gpu_ms_per_step']:7.1f} "
            f"{r['ms_per_step']:7.1f}"
        )
