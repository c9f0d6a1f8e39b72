"""Where a training step's GPU time goes: kernel time by family and by phase (forward / backward), from torch.profiler.

bench_train.py and bench_memory.py --profile run this on their rows. Each profiled step runs forward and backward (+ optimizer) in
record_function ranges that end with a device synchronize, so every kernel starts inside the range of the phase
that launched it; a kernel's phase is read from its start time.

Families (the first rule that matches decides):
  8-bit GEMM           kernels launched by aten::_scaled_mm / aten::_int_mm (cuBLAS fp8 / int8: their names do
                       not say so) and this package's Triton GEMMs (_scaled_mm_kernel, _scaled_mm_tma_kernel)
  quantize/cast        this package's quantize kernels, Inductor kernels whose fused ops say absmax or a cast to 8
                       bits (amax, round, clamp) or that only cast (triton_poi_fused__to_copy_0), and eager dtype
                       copies. A dequantize or cast that Inductor fused into other pointwise work cannot be told
                       apart and counts as norm + elementwise.
  attention            flash / memory-efficient / cuDNN attention, forward and backward
  optimizer            AdamW's multi-tensor kernels
  16-bit GEMM          cuBLAS / CUTLASS GEMMs (and cuDNN's implicit-GEMM convolution of the patch embedding)
  norm + elementwise   Inductor's other kernels (fused pointwise and reductions: LayerNorm, GELU, residual adds)
                       and eager elementwise, reduction, norm and softmax kernels
  other                the rest (memcpy / memset, fills, indexing)

Recompute is not a kernel family (a recomputed op runs the same kernel as in forward, or is fused into a backward
kernel by Inductor), so it is reported beside the families:
  attention forward kernels that run in backward (exact: HF checkpointing or the partitioner re-ran attention);
  GEMM calls in backward beyond two per forward GEMM (grad-input and grad-weight), valued at the forward GEMMs'
  mean time per call (an estimate: which GEMMs were recomputed is not known). Elementwise work that the
  partitioner recomputes inside fused backward kernels is not separable and is not counted.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

FORWARD, BACKWARD, OUTSIDE = "forward", "backward", "outside"
MARK = "step_profile:"
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
# attention kernels of a backward pass (flash bwd, cuDNN bprop, CUTLASS fmha backward); the others are forward's
ATTENTION_BACKWARD = ("bwd", "bprop", "cutlassb", "backward")
# the CPU's GEMM ops, which stand in for kernels when a CPU run is profiled (the smoke test)
CPU_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
# kernels that are part of a GEMM without being one (split-K reduction): time counted, calls not
GEMM_HELPERS = ("splitkreduce", "reduce_kernel")


@dataclass(frozen=True)
class Kernel:
    """One kernel run: its name, the phase that launched it, its time in ms."""

    name: str
    phase: str
    ms: float


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


def is_attention_forward(name: str) -> bool:
    lowered = name.lower()
    return family(name) == ATTENTION and not any(mark in lowered for mark in ATTENTION_BACKWARD)


def gemm_call(name: str, fam: str) -> bool:
    return fam in (GEMM_8BIT, GEMM_16BIT) and not any(h in name.lower() for h in GEMM_HELPERS)


def summarize(kernels: list[Kernel], steps: int, eight_bit: frozenset[str] = frozenset()) -> dict:
    """Per step: ms and calls by family x phase, the recompute figures (see the module docstring), GPU busy time."""
    by = {fam: {FORWARD: 0.0, BACKWARD: 0.0, OUTSIDE: 0.0} for fam in FAMILIES}
    calls = {fam: {FORWARD: 0, BACKWARD: 0, OUTSIDE: 0} for fam in FAMILIES}
    gemm_calls = {FORWARD: 0, BACKWARD: 0, OUTSIDE: 0}
    gemm_ms = {FORWARD: 0.0, BACKWARD: 0.0, OUTSIDE: 0.0}
    attention_rerun_ms, attention_rerun_calls = 0.0, 0
    for k in kernels:
        fam = family(k.name, eight_bit)
        by[fam][k.phase] += k.ms / steps
        calls[fam][k.phase] += 1
        if gemm_call(k.name, fam):
            gemm_calls[k.phase] += 1
            gemm_ms[k.phase] += k.ms / steps
        if k.phase == BACKWARD and is_attention_forward(k.name):
            attention_rerun_ms += k.ms / steps
            attention_rerun_calls += 1
    fwd_calls = gemm_calls[FORWARD] / steps
    extra_gemms = max(0.0, gemm_calls[BACKWARD] / steps - 2 * fwd_calls)
    mean_fwd_gemm = gemm_ms[FORWARD] / fwd_calls if fwd_calls else 0.0
    return dict(
        gpu_ms_per_step=sum(ms for phases in by.values() for ms in phases.values()),
        ms=by,
        calls_per_step={fam: {p: n / steps for p, n in phases.items()} for fam, phases in calls.items()},
        gemm_calls_per_step={p: n / steps for p, n in gemm_calls.items()},
        recompute=dict(
            attention_forward_in_backward_ms=attention_rerun_ms,
            attention_forward_in_backward_calls=attention_rerun_calls / steps,
            extra_backward_gemm_calls=extra_gemms,
            extra_backward_gemm_ms_est=extra_gemms * mean_fwd_gemm,
        ),
    )


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
        Kernel(e.name, phase_of(e.time_range.start, ranges), e.time_range.elapsed_us() / 1000)
        for e in events
        # record_function ranges (Inductor's "## Call CompiledFxGraph ##", the phase marks) also appear on the
        # GPU's timeline as user annotations spanning kernels: not kernels themselves
        if e.device_type == device_type and not e.is_user_annotation and not e.name.startswith(MARK)
    ]
    return kernels, eight_bit


def profile(forward, finish, steps: int, device: str) -> tuple[list[Kernel], frozenset[str], float]:
    """Run `steps` training steps (forward() -> loss, finish(loss)) under torch.profiler, phases marked; returns
    the kernels, the 8-bit GEMM kernel names and the profiled wall ms per step (synchronizes and the profiler
    slow it: read it as a bound, not a figure)."""
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
    device_type = None if device == "cuda" else torch.autograd.DeviceType.CPU
    kernels, eight_bit = collect(prof, device_type)
    return kernels, eight_bit, wall_ms


def report(title: str, summary: dict, kernels: list[Kernel], steps: int, eight_bit, top: int = 40) -> str:
    """The text report: the family x phase table, the recompute figures, the top kernels by total time."""
    lines = [title, ""]
    lines.append(
        f"{'family':22} {'fwd ms':>8} {'calls':>6} {'bwd ms':>8} {'calls':>6} {'total ms':>9} {'share':>6}"
    )
    total = summary["gpu_ms_per_step"] or 1.0
    for fam in FAMILIES:
        ms, n = summary["ms"][fam], summary["calls_per_step"][fam]
        fam_total = sum(ms.values())
        lines.append(
            f"{fam:22} {ms[FORWARD]:8.1f} {n[FORWARD]:6.0f} {ms[BACKWARD]:8.1f} {n[BACKWARD]:6.0f} "
            f"{fam_total:9.1f} {fam_total / total:6.1%}"
        )
    lines.append(f"{'GPU busy (sum)':22} {'':>8} {'':>6} {'':>8} {'':>6} {summary['gpu_ms_per_step']:9.1f}")
    rec, g = summary["recompute"], summary["gemm_calls_per_step"]
    lines += [
        "",
        f"recompute: attention forward in backward {rec['attention_forward_in_backward_ms']:.1f} ms "
        f"({rec['attention_forward_in_backward_calls']:.0f} calls); GEMM calls forward {g[FORWARD]:.0f}, backward "
        f"{g[BACKWARD]:.0f}: {rec['extra_backward_gemm_calls']:.0f} beyond 2 per forward GEMM, "
        f"~{rec['extra_backward_gemm_ms_est']:.1f} ms at the forward mean (estimate)",
        "",
        f"{'ms/step':>8} {'calls':>6} {'phase':8} {'family':20} kernel",
    ]
    totals: dict[tuple[str, str], list[float]] = {}
    for k in kernels:
        entry = totals.setdefault((k.name, k.phase), [0.0, 0])
        entry[0] += k.ms / steps
        entry[1] += 1 / steps
    for (name, phase), (ms, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{ms:8.2f} {n:6.0f} {phase:8} {family(name, eight_bit):20} {name[:150]}")
    return "\n".join(lines) + "\n"


def profile_row(forward, finish, steps: int, device: str, path: Path, title: str) -> dict:
    """Profile `steps` steps, write the text report to `path`, return the summary (for the row's JSON)."""
    kernels, eight_bit, wall_ms = profile(forward, finish, steps, device)
    summary = summarize(kernels, steps, eight_bit)
    summary["profiled_wall_ms_per_step"] = wall_ms
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report(title, summary, kernels, steps, eight_bit))
    summary["report"] = str(path)
    path.with_suffix(".json").write_text(json.dumps(dict(title=title, **summary), indent=1))
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
        rec = prof["recompute"]
        print(
            f"{'':50} recompute: attention forward in backward {rec['attention_forward_in_backward_ms']:.1f} ms, "
            f"{rec['extra_backward_gemm_calls']:.0f} extra backward GEMMs ~{rec['extra_backward_gemm_ms_est']:.1f} "
            f"ms (est.); report {prof['report']}"
        )
