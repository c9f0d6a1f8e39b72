"""Where the host was while the GPU waited: the GPU's idle gaps of a profiled step, read from its Chrome trace.

A gap before kernel K is the host's when K started right after its launch returned (the queue had run dry: the
GPU waited for the host to reach K's launch); otherwise K was launched early and waited on something on the GPU
side (another stream, an event). For the host's gaps, what the launching thread ran between the launch of the
kernel before the gap and K's launch says what made the host late. step_profile.py calls this on the step it runs
without synchronizes (bench_train.py --profile, `host_waits` in the JSON).
"""

from __future__ import annotations

GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")
# a kernel that started within this long after its launch returned found the queue empty: the host was late
HOST_LATE_US = 30.0
MIN_GAP_US = 10.0
TOP = 12


def _events(trace: dict, categories: tuple[str, ...]) -> list[dict]:
    return [e for e in trace.get("traceEvents", ()) if e.get("ph") == "X" and e.get("cat") in categories]


def _name(e: dict) -> str:
    return str(e.get("name", ""))[:90]


def host_waits(trace: dict, after_us: float = float("-inf"), top: int = TOP) -> dict:
    """The GPU gaps (>= MIN_GAP_US) between kernels that start at or after `after_us`, split into the host's
    (the next kernel started within HOST_LATE_US of its launch's return) and the rest; for the host's, the
    enclosing host ops of the late launch summed by name (which op's launches the GPU waited for) and the
    `top` largest gaps with the host ops that ran between the two launches (longest first)."""
    gpu = sorted((e for e in _events(trace, GPU_CATEGORIES) if e["ts"] >= after_us), key=lambda e: e["ts"])
    if not gpu:
        return {}
    launches = {e["args"]["correlation"]: e for e in _events(trace, LAUNCH_CATEGORIES) if "args" in e}
    host_ops = sorted(_events(trace, HOST_CATEGORIES), key=lambda e: e["ts"])
    host_ms = other_ms = 0.0
    by_op: dict[str, list[float]] = {}
    gaps = []
    end, previous = gpu[0]["ts"] + gpu[0].get("dur", 0.0), gpu[0]
    for k in gpu[1:]:
        gap = k["ts"] - end
        if gap >= MIN_GAP_US:
            launch = launches.get(k.get("args", {}).get("correlation"))
            before = launches.get(previous.get("args", {}).get("correlation"))
            late = launch is not None and k["ts"] - (launch["ts"] + launch.get("dur", 0.0)) <= HOST_LATE_US
            if late:
                host_ms += gap / 1000
                chain = _enclosing(host_ops, launch)
                key = " > ".join(chain[-2:]) if chain else "(no host op)"
                entry = by_op.setdefault(key, [0.0, 0])
                entry[0], entry[1] = entry[0] + gap / 1000, entry[1] + 1
                gaps.append((gap, previous, k, launch, before, chain))
            else:
                other_ms += gap / 1000
        if k["ts"] + k.get("dur", 0.0) >= end:
            end, previous = k["ts"] + k.get("dur", 0.0), k
    ranked = sorted(by_op.items(), key=lambda item: -item[1][0])[:top]
    largest = sorted(gaps, key=lambda g: -g[0])[:top]
    return dict(
        host_late_ms=host_ms,
        gpu_side_ms=other_ms,
        host_late_by_launching_op=[dict(op=op, ms=ms, gaps=n) for op, (ms, n) in ranked],
        largest_host_gaps=[_describe(g, host_ops) for g in largest],
    )


def _enclosing(host_ops: list[dict], launch: dict) -> list[str]:
    """Names of the host ops on the launch's thread that enclose it, outermost first."""
    t = launch["ts"]
    return [
        _name(e)
        for e in host_ops
        if e.get("tid") == launch.get("tid") and e["ts"] <= t <= e["ts"] + e.get("dur", 0.0)
    ]


def _describe(gap_entry, host_ops: list[dict]) -> dict:
    gap, previous, k, launch, before, chain = gap_entry
    described = dict(ms=gap / 1000, before=_name(previous), after=_name(k), launched_in=chain[-4:])
    if before is not None and before.get("tid") == launch.get("tid"):
        lo, hi = before["ts"], launch["ts"]
        between = [
            e for e in host_ops if e.get("tid") == launch.get("tid") and lo <= e["ts"] and e["ts"] < hi
        ]
        longest = sorted(between, key=lambda e: -e.get("dur", 0.0))[:5]
        described.update(
            host_ms_between_launches=(hi - lo) / 1000,
            longest_host_ops_between=[dict(op=_name(e), ms=e.get("dur", 0.0) / 1000) for e in longest],
        )
    return described
