"""Compile warm-up of a training step: each row in fresh bench_train.py processes with caches of its own.

Passes per (model, variant), each its own process on its own Inductor and Triton cache folders: cold (empty
caches), warm (the same caches again; --warm_passes times), moved (--moved: empty caches plus the artifacts cold
saved, as train_clip.py --compile_cache_dir on another machine). Each pass runs every variant in turn before the
next pass starts, so that drift of the host lands on all variants alike. Per row: the first step's seconds, its
ratio to --baseline within the same pass and the FX graph cache's hit/miss/bypass; where a variant has several
rows per pass (--repeats, --warm_passes), their median and the ratio of the medians; then, per model and pass,
the seconds each variant's first step takes over the baseline's, split by compile stage, and the slowest Triton
kernel compiles of each graph (compile_stages.py). The first step of one process moves by seconds cold and by
tenths of a second warm between processes of the same variant: a ratio target needs the medians. An untimed
eager process runs first (--no_prime skips it), so that reading the libraries from disk does not land on the
first row. Flags it does not know go to bench_train.py.

    PYTHONPATH=src python benchmarks/compile_warmup.py --models vit-b-16 --variants bf16+compile int8+compile \\
        --compile layers --warm_passes 3 --moved --json $OUT/warmup.json
    PYTHONPATH=src python benchmarks/compile_warmup.py --tiny --variants bf16 int8  # smoke test
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402
from compile_stages import (  # noqa: E402
    extra_by_stage,
    kernel_compiles,
    print_extra_by_stage,
    print_kernel_compiles,
    same_pass,
)


def run_row(model: str, variant: str, cache: Path, args, extra: list[str]) -> dict:
    """One bench_train.py process for one row, on the caches under `cache`; its JSON row (or the error)."""
    out = cache / f"row_{time.monotonic_ns()}.json"
    env = dict(
        os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton")
    )
    command = [str(HERE / "bench_train.py"), "--models", model, "--variants", variant]
    command += ["--json", str(out), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--device", args.device, *(["--batch", str(args.batch)] if args.batch else [])]
    command += [*(["--tiny"] if args.tiny else []), *extra]
    return common.row_in_process(command, out, env, args.timeout_s)


def passes(args) -> list[tuple[str, int]]:
    """(pass, round) in the order they run: cold, then the warm rounds, then moved."""
    order = [("cold", 0), *(("warm", i) for i in range(args.warm_passes))]
    return order + ([("moved", 0)] if args.moved else [])


def measure(args, extra: list[str]) -> list[dict]:
    root = Path(args.cache_root or tempfile.mkdtemp(prefix="compile_warmup_"))
    if not args.no_prime:
        run_row(args.models[0], "bf16", root / "prime", args, extra)
    rows = []
    for repeat in range(args.repeats):
        for model in args.models:
            for cache_pass, round_ in passes(args):
                for variant in args.variants:
                    cache = root / f"{model}_{variant.replace('+', '_')}" / f"repeat{repeat}"
                    artifacts = ["--compile_artifacts", str(cache / "compile_artifacts.bin")]
                    # cold saves the artifacts (with --moved), moved loads them; warm's caches hold everything
                    folder = cache / "moved" if cache_pass == "moved" else cache
                    folder.mkdir(parents=True, exist_ok=True)
                    more = artifacts if args.moved and cache_pass != "warm" else []
                    row = dict(
                        run_row(model, variant, folder, args, extra + more), model=model, variant=variant
                    )
                    row.update(cache=str(folder), repeat=repeat, round=round_, **{"pass": cache_pass})
                    rows.append(row)
                    common.emit(rows, dict(args=vars(args), extra=extra), args.json)
    return rows


def print_table(rows: list[dict], baseline: str) -> None:
    base = {same_pass(r): r["first_step_s"] for r in rows if r["variant"] == baseline and "first_step_s" in r}
    outcomes = ("fx_graph_hit", "fx_graph_miss", "fx_graph_bypass")
    caches = lambda r: "/".join(str(r["first_step_caches"][o]) for o in outcomes)  # noqa: E731
    cols = [("1st step s", lambda r: r["first_step_s"], ".2f")]
    cols += [(f"x {baseline}", lambda r: common.ratio(r["first_step_s"], base.get(same_pass(r))), "")]
    cols += [("ms/step", lambda r: r["ms_per_step"], ".1f")]
    cols += [("graphs hit/miss/bypass", lambda r: caches(r) if r.get("first_step_caches") else "-", "")]
    lead = [("model", "model", 11), ("variant", "variant", 28), ("pass", "pass", 5), ("rep", "repeat", 3)]
    lead += [("rnd", "round", 3)]
    common.print_table(rows, lead, cols, "first_step_s")


def medians(rows: list[dict], baseline: str) -> list[dict]:
    """Per (model, pass, variant) with first steps: their median, how many, and the ratio of that median to the
    baseline's median of the same model and pass."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        if "first_step_s" in r:
            groups.setdefault((r["model"], r["pass"], r["variant"]), []).append(r["first_step_s"])
    out = []
    for (model, cache_pass, variant), seconds in groups.items():
        reference = groups.get((model, cache_pass, baseline))
        median = statistics.median(seconds)
        row = dict(
            model=model,
            variant=variant,
            n=len(seconds),
            median_s=median,
            spread_s=max(seconds) - min(seconds),
        )
        row["ratio"] = median / statistics.median(reference) if reference else None
        out.append(dict(row, **{"pass": cache_pass}))
    return out


def print_medians(summary: list[dict], baseline: str) -> None:
    if not any(m["n"] > 1 for m in summary):
        return  # one row per group: the table above says it all
    print(f"\nfirst step, median over processes (ratio of the medians to {baseline}'s; spread: max - min)")
    cols = [("median s", lambda m: m["median_s"], ".2f"), ("spread s", lambda m: m["spread_s"], ".2f")]
    cols += [(f"x {baseline}", lambda m: "-" if m["ratio"] is None else f"{m['ratio']:.2f}x", "")]
    lead = [("model", "model", 11), ("variant", "variant", 28), ("pass", "pass", 5), ("n", "n", 2)]
    common.print_table(summary, lead, cols, "median_s")


def main() -> None:
    parser = common.parser_of(__doc__)
    parser.add_argument("--models", nargs="+", default=["vit-b-16"], help="bench_train.py model names")
    parser.add_argument("--variants", nargs="+", default=["bf16+compile", "int8+compile"], help="rows")
    parser.add_argument("--baseline", help="the ratio column's reference (default: the first variant)")
    parser.add_argument("--batch", type=int, default=None, help="per-step batch (default: bench_train.py's)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (the ms/step column)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    parser.add_argument(
        "--cache_root",
        default=None,
        help="where the cache folders go (default: a temp dir); kernel_compile_times.py reads a row's inductor/ there",
    )
    parser.add_argument("--repeats", type=int, default=1, help="measure every row this often, on new caches")
    parser.add_argument(
        "--warm_passes",
        type=int,
        default=1,
        help="warm processes per cold one (their median is reported); 0: none (cold, and moved with --moved)",
    )
    parser.add_argument("--no_prime", action="store_true", help="skip the untimed first (eager) process")
    parser.add_argument("--moved", action="store_true", help="a third pass: empty caches + cold's artifacts")
    parser.add_argument("--timeout_s", type=float, default=900, help="per process")
    parser.add_argument("--json", default=None, help="also write the rows here (after every row)")
    common.add_smoke_flags(parser)
    args, extra = parser.parse_known_args()
    if args.warm_passes < 0 or args.repeats < 1:
        parser.error("--warm_passes must be >= 0 and --repeats >= 1")
    if args.tiny:
        args.device = "cpu"
    common.check_device(parser, args)
    rows = measure(args, extra)
    baseline = args.baseline or args.variants[0]
    print_table(rows, baseline)
    summary = medians(rows, baseline)
    print_medians(summary, baseline)
    if args.json:  # the rows as emitted, plus the medians
        env = dict(args=vars(args), extra=extra)
        Path(args.json).write_text(json.dumps(dict(env=env, rows=rows, medians=summary), indent=1))
    print_extra_by_stage(extra_by_stage(rows, baseline), baseline)
    print_kernel_compiles(kernel_compiles(rows))
    if any("first_step_s" not in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
