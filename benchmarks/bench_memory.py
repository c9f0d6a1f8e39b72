"""Memory: the largest per-GPU CLIP batch each training configuration fits, and how fast it trains there.

bf16 reaches large batches by recomputing (+ckpt, or +budgetF: torch.compile's selective recompute);
SwitchBack's memory switch (int8-memeff, fp8-memeff) saves activations in 8 bits instead. Rows are
bench_train.py's (same model, step, variants and row grammar), plus the memory the forward leaves saved for
backward per sample and the largest batch (--fit). Ratios: samples/s over the fastest bf16 row that recomputes
(x bf16 rec) and over bf16+compile (x bf16+c), same batch.

    PYTHONPATH=src python benchmarks/bench_memory.py --compile layers --models vit-h-14 --batch 192 \\
        --variants bf16+budget0.75+compile int8-memeff+compile bf16+compile@128 --fit search \\
        --fit_variants bf16+compile@128 int8-memeff+compile --profile $OUT/prof --json $OUT/mem.json
    PYTHONPATH=src python benchmarks/bench_memory.py --device cpu --tiny --variants bf16 int8-memeff  # smoke

--fit estimate (default): peak(batch) = fixed + batch x per-sample from the row's own run (errs low); --fit
search: then bisection from that estimate with out-of-memory caught, at most --fit_tries runs per row.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train
import common
import step_profile

DEFAULT_VARIANTS = ("bf16+compile", "bf16+ckpt+compile", "bf16+budget0.5+compile", "int8-memeff+compile")
GIB = 2**30
BATCH_MULTIPLE = 8  # --fit search tries batches that are multiples of this
parse_variant = bench_train.parse_variant


def attempt(name: str, spec: str, batch: int, args, clock: common.Clock | None = None, profile=False) -> dict:
    """bench_train's row at `batch`, failures (out of memory above all) recorded in the row."""
    key = dict(model=name, variant=spec, batch=batch)
    return bench_train.attempt(key, args.device, clock, bench_train.run_row, name, spec, args, profile, batch)


def estimate_max_batch(row: dict, cap: int) -> int | None:
    """Largest batch under `cap` bytes by peak = fixed + batch x per-sample (see --fit estimate)."""
    per_sample = row.get("peak_mib_per_sample")
    if not per_sample or per_sample <= 0:
        return None
    return max(0, math.floor((cap / GIB - row["fixed_gib"]) * 1024 / per_sample))


def fit(name: str, spec: str, first: dict, args, cap: int, mode: str | None = None, clock=None) -> dict:
    """The largest batch found for one configuration (see --fit; `mode` overrides args.fit), bisecting in
    multiples of BATCH_MULTIPLE; `first` is its run at the row's batch."""
    mode = mode or args.fit
    estimate = estimate_max_batch(first, cap) if "ms_per_step" in first else None
    out = dict(max_batch_est=estimate)
    if mode == "estimate" or estimate is None:
        return out
    step, runs = BATCH_MULTIPLE, []
    # the estimate errs low, so 1.25x it is assumed not to fit until a run says otherwise
    ok, bad = first["batch"], max(math.ceil(1.25 * estimate / step) * step, first["batch"] + step)
    out.update(max_batch=ok, max_batch_samples_per_s=first["samples_per_s"], search_upper=bad)
    batch = estimate // step * step
    for _ in range(args.fit_tries):
        if not ok < batch < bad:
            batch = (ok + bad) // 2 // step * step
        if batch <= ok:
            break
        runs.append(attempt(name, spec, batch, args, clock))
        if "ms_per_step" in runs[-1]:
            ok = batch
            out.update(max_batch=batch, max_batch_samples_per_s=runs[-1]["samples_per_s"])
        elif runs[-1].get("status") == "skipped":
            break
        else:
            bad = batch
        batch = (ok + bad) // 2 // step * step
    out["oom_at"] = bad if bad != out["search_upper"] else None
    keys = ("batch", "status", "samples_per_s", "peak_mem_gib")
    out["fit_runs"] = [{k: r.get(k) for k in keys} for r in runs]
    return out


def print_table(rows: list[dict]) -> None:
    best, plain = {}, {}  # the fastest bf16 row that recomputes; bf16 + compile without recompute
    for r in rows:
        v, key = parse_variant(r["variant"]), (r["model"], r["batch"])
        if "samples_per_s" in r and v.base == "bf16" and (v.grad_ckpt or v.budget is not None):
            best[key] = max(best.get(key, 0.0), r["samples_per_s"])
        elif "samples_per_s" in r and v.base == "bf16" and v.compiled:
            plain[key] = r["samples_per_s"]
    cols = [
        ("ms/step", lambda r: r["ms_per_step"], ".1f"),
        ("samples/s", lambda r: r["samples_per_s"], ".1f"),
    ]
    for title, ref in (("x bf16 rec", best), ("x bf16+c", plain)):
        vs = lambda r, ref=ref: common.ratio(r["samples_per_s"], ref.get((r["model"], r["batch"])))  # noqa: E731
        cols.append((title, vs, ""))
    cols += [("peak GiB", lambda r: r["peak_mem_gib"], ".1f")]
    cols += [("saved MiB/sample", lambda r: r.get("saved_mib_per_sample"), ".1f")]
    cols += [("max b est", lambda r: r.get("max_batch_est"), ""), ("max b", lambda r: r.get("max_batch"), "")]
    cols += [("1st s", lambda r: r["first_step_s"], ".1f")]
    lead = [("model", "model", 9), ("variant", "variant", 40), ("batch", "batch", 5)]
    common.print_table(rows, lead, cols, "ms_per_step")
    step_profile.print_profiles(rows)


def run(args: argparse.Namespace) -> list[dict]:
    env = dict(common.versions(args.device), args=vars(args))
    cap = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else 0
    env["mem_cap_gib"] = cap / GIB
    print(json.dumps(env), flush=True)
    rows, clock = [], common.Clock(args.time_budget_s)
    for name in args.models:
        for spec in args.variants:
            t0, batch = clock.elapsed(), bench_train.row_batch(name, parse_variant(spec), args)
            profile = bool(args.profile) and (not args.profile_variants or spec in args.profile_variants)
            row = attempt(name, spec, batch, args, clock, profile)
            if args.device == "cuda" and row.get("status") != "skipped":
                fitting = not args.fit_variants or spec in args.fit_variants
                row.update(fit(name, spec, row, args, cap, args.fit if fitting else "estimate", clock))
            row["row_s"] = clock.elapsed() - t0
            rows.append(row)
            common.emit(rows, env, args.json)
    print_table(rows)
    return rows


def main() -> None:
    parser = common.parser_of(__doc__)
    bench_train.add_row_flags(parser, DEFAULT_VARIANTS, steps=4, warmup=1)
    parser.set_defaults(models=["vit-h-14"])
    parser.add_argument("--fit", choices=("estimate", "search"), default="estimate", help="see above")
    spec_list = dict(nargs="+", type=bench_train.spec_arg, metavar="SPEC")
    parser.add_argument("--fit_variants", **spec_list, help="rows --fit search runs for (default: all)")
    parser.add_argument("--fit_tries", type=int, default=3, help="runs per row that --fit may add")
    parser.add_argument("--profile_variants", **spec_list, help="rows --profile profiles (default: all)")
    args = parser.parse_args()
    common.check_device(parser, args)
    run(args)


if __name__ == "__main__":
    main()
