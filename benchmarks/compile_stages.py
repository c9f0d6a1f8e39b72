"""Where a compiled run's first step spends the seconds it takes over a baseline's, by compile stage.

bench_train.py records torch's compile timers of the first step (`first_step_compile_s`: torch._dynamo's
`compilation_time_metrics`, seconds per timer name) and the TTIR analyses of our kernels (`first_step_ttir`).
The timers nest (AOT autograd's dispatcher holds Inductor's whole compile, for one), so this module sums only
timers that do not hold one another, in the order a cold start runs them; what they leave out (the step's
own run, process work, timers not listed) is the "rest". The TTIR analyses run inside the AOT trace and the
post-grad passes, so they are shown as a part of those, not added; so is "serial", the part of "kernels" that
Inductor compiled in the main process, one kernel after another, before its compile workers were up
(`async_compile.precompile`; compile_cache.start_compile_workers says why).

    stages = extra_by_stage(rows, "bf16+compile")   # rows of compile_warmup.py
    print_extra_by_stage(stages, "bf16+compile")
    print_kernel_compiles(kernel_compiles(rows))       # the slowest Triton kernel compiles of each graph

The "kernels" stage is a wait on Inductor's compile workers, which compile a graph's kernels in parallel, so
what sets it is how long the slowest kernels of each graph take in their workers: bench_train.py records each
kernel's compile time in its worker, per graph (`first_step_kernel_compiles`), which kernel_compiles summarizes;
kernel_compile_times.py compiles the same kernels one by one, for their own compile time without the host's load.
"""

from __future__ import annotations

from collections import defaultdict

import common

# (column, torch's timer names summed into it); no timer here holds another listed timer
STAGES = (
    ("Dynamo", ("bytecode_tracing",)),
    ("AOT trace", ("aot_collect_metadata", "aot_trace_joint_graph")),
    ("joint+partition", ("_recursive_joint_graph_passes", "min_cut_rematerialization_partition")),
    ("lowering", ("_recursive_post_grad_passes", "GraphLowering.run")),
    ("codegen", ("GraphLowering.codegen",)),
    ("kernels", ("PyCodeCache.load_by_key_path",)),  # compiled (cold) or loaded (warm), waits included
    ("autotune", ("CachingAutotuner.benchmark_all_configs",)),
    ("guards", ("build_guards",)),
)


def stage_seconds(row: dict) -> dict[str, float]:
    """One row's first step split by stage: {column: seconds}, plus "TTIR" (inside the AOT trace and lowering),
    "serial" (inside "kernels") and "rest" (first step minus the stages). {} for a row without a first step."""
    if "first_step_s" not in row:
        return {}
    timers = row.get("first_step_compile_s") or {}
    stages = {name: sum(timers.get(timer, 0.0) for timer in names) for name, names in STAGES}
    stages["TTIR"] = (row.get("first_step_ttir") or {}).get("s", 0.0)
    stages["serial"] = timers.get("async_compile.precompile", 0.0)
    stages["rest"] = row["first_step_s"] - sum(stages[name] for name, _ in STAGES)
    return stages


def same_pass(row: dict) -> tuple:
    """What a row's ratio to the baseline is taken within: its model, pass, repeat and warm round."""
    return (row["model"], row["pass"], row["repeat"], row.get("round", 0))


def extra_by_stage(rows: list[dict], baseline: str) -> list[dict]:
    """Per (model, pass, variant) other than `baseline`: the mean over repeats (and warm rounds) of its stage
    seconds minus the baseline's of the same model, pass, repeat and round ("total": the first step's), with
    "repeats" counted."""
    base = {same_pass(r): r for r in rows if r["variant"] == baseline}
    sums: dict[tuple, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    counts: dict[tuple, int] = defaultdict(int)
    for r in rows:
        reference = base.get(same_pass(r))
        if r["variant"] == baseline or reference is None:
            continue
        mine, theirs = stage_seconds(r), stage_seconds(reference)
        if not mine or not theirs:
            continue
        group = (r["model"], r["pass"], r["variant"])
        sums[group]["total"] += r["first_step_s"] - reference["first_step_s"]
        for name, seconds in mine.items():
            sums[group][name] += seconds - theirs[name]
        counts[group] += 1
    extra = []
    for group, stage_sums in sums.items():
        model, cache_pass, variant = group
        means = {name: total / counts[group] for name, total in stage_sums.items()}
        extra.append(
            dict(model=model, variant=variant, repeats=counts[group], **{"pass": cache_pass}, **means)
        )
    return extra


def print_extra_by_stage(extra: list[dict], baseline: str) -> None:
    """The table of extra_by_stage: seconds over `baseline`, by stage."""
    if not extra:
        return
    print(
        f"\nfirst step, seconds over {baseline} by compile stage (mean of the repeats; TTIR: inside AOT + lowering; "
        "serial: kernels compiled in the main process, inside kernels)"
    )
    columns = ["total", *(name for name, _ in STAGES), "rest", "TTIR", "serial"]
    lead = [("model", "model", 11), ("variant", "variant", 24), ("pass", "pass", 5), ("n", "repeats", 2)]
    common.print_table(extra, lead, [(c, lambda e, c=c: e[c], "+.2f") for c in columns], "total")


def kernel_compiles(rows: list[dict], slowest: int = 3) -> list[dict]:
    """Per row and graph with kernel compiles (cold rows): how many kernels torch recorded (at most its 25
    slowest), their summed compile seconds, the slowest one's, and the `slowest` kernels as "name s"."""
    out = []
    for r in rows:
        for graph in r.get("first_step_kernel_compiles") or []:
            kernels = graph["kernels"]
            side = {True: "fwd", False: "bwd"}.get(graph.get("forward"), "?")
            out.append(
                dict(
                    model=r["model"],
                    variant=r["variant"],
                    repeat=r.get("repeat", 0),
                    graph=f"{graph['graph']} {side}",
                    recorded=len(kernels),
                    total_s=sum(seconds for _, seconds in kernels),
                    max_s=max(seconds for _, seconds in kernels),
                    names=", ".join(f"{name} {seconds:.2f}" for name, seconds in kernels[:slowest]),
                    **{"pass": r.get("pass", "")},
                )
            )
    return out


def print_kernel_compiles(compiles: list[dict]) -> None:
    """The table of kernel_compiles."""
    if not compiles:
        return
    print(
        "\nTriton kernel compiles per graph (each in a worker, in parallel: max_s is the least the graph waits)"
    )
    lead = [("model", "model", 11), ("variant", "variant", 24), ("pass", "pass", 5), ("rep", "repeat", 3)]
    lead += [("graph", "graph", 10)]
    cols = [("kernels", lambda c: c["recorded"], "d"), ("total_s", lambda c: c["total_s"], ".2f")]
    cols += [("max_s", lambda c: c["max_s"], ".2f")]
    common.print_table(compiles, lead, cols, "max_s")
    for c in compiles:
        print(f"  {c['model']} {c['variant']} {c['pass']} {c['repeat']} {c['graph']}: {c['names']}")
