"""Memory: the largest per-GPU CLIP batch each training configuration fits, and how fast it trains there.

bf16 reaches large batches by recomputing (+ckpt, or +budgetF: torch.compile's selective recompute);
SwitchBack's memory switch (int8-memeff, fp8-memeff) saves activations in 8 bits instead. Rows are
bench_train.py's (same model, step, variants and row grammar), plus the memory the forward leaves saved for
backward per sample and the largest batch (--fit). Ratios: samples/s over the fastest bf16 row that recomputes
(x bf16 rec) and over bf16+compile (x bf16+c), same batch.

    PYTHONPATH=src python benchmarks/bench_memory.py --compile layers --models vit-h-14 --batch 192 \\
        --variants bf16+budget0.75+compile int8-memeff+compile bf16+compile@128 --fit search \\
        --fit_variants bf16+compile@128 int8-memeff+compile --profile $OUT/prof --json $OUT/mem.json
    PYTHONPATH=src python benchmarks/bench_memory.py --saved_tensors --models vit-h-14 --variants bf16 int8-memeff
    PYTHONPATH=src python benchmarks/bench_memory.py --device cpu --tiny --variants bf16 int8-memeff  # smoke

--fit (for --fit_variants, default all rows):
  estimate  (default) peak(batch) = fixed + batch x per-sample from the row's own run, fixed = memory between
            steps + one gradient per parameter; the rest counts as per-sample, so it errs low. No extra runs.
  search    a run at the estimate, then bisection between the largest batch that fit and the smallest that did
            not (1.25x the estimate until one fails), at most --fit_tries runs. A compiled row recompiles per batch.
--saved_tensors: instead of training, what one vision encoder layer saves for backward, bytes per token.
"""

from __future__ import annotations

import argparse
import contextlib
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
parse_variant = bench_train.parse_variant


def attempt(name: str, spec: str, batch: int, args, clock: common.Clock | None = None, profile=False) -> dict:
    """bench_train's row at `batch`, failures (out of memory above all) recorded in the row."""
    key = dict(model=name, variant=spec, batch=batch)
    return bench_train.attempt(
        key, args.device, clock, bench_train.run_row, name, spec, False, args, profile, batch
    )


def estimate_max_batch(row: dict, cap: int) -> int | None:
    """Largest batch under `cap` bytes by peak = fixed + batch x per-sample (see --fit estimate)."""
    per_sample = row.get("peak_mib_per_sample")
    if not per_sample or per_sample <= 0:
        return None
    return max(0, math.floor((cap / GIB - row["fixed_gib"]) * 1024 / per_sample))


def fit(name: str, spec: str, first: dict, args, cap: int, mode: str | None = None, clock=None) -> dict:
    """The largest batch found for one configuration (see --fit; `mode` overrides args.fit), bisecting in
    multiples of --batch_multiple; `first` is its run at the row's batch."""
    mode = mode or args.fit
    estimate = estimate_max_batch(first, cap) if "ms_per_step" in first else None
    out = dict(max_batch_est=estimate)
    if mode == "estimate" or estimate is None:
        return out
    step, runs = args.batch_multiple, []
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


def saved_by_graph(output: torch.Tensor, params: set[int]) -> list[dict]:
    """Every tensor the autograd graph behind `output` holds for backward, once per storage, except `params`
    (storage data_ptrs). Reads built-in nodes' `_saved_*` and custom / compiled functions' `saved_tensors`, so
    under compile it lists what the partitioner kept."""
    seen, found, stack, visited = set(), [], [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        stack.extend(fn for fn, _ in node.next_functions)
        held = []
        for attr in [a for a in dir(node) if a.startswith("_saved_")] + ["saved_tensors"]:
            with contextlib.suppress(Exception):  # some attributes are freed or not tensors
                value = getattr(node, attr)
                held += [(attr, t) for t in (value if isinstance(value, (tuple, list)) else (value,))]
        for attr, tensor in held:
            if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.data_ptr() in params:
                continue
            seen.add(storage.data_ptr())
            dtype = str(tensor.dtype).removeprefix("torch.")
            found.append(
                dict(
                    node=node.name(), attr=attr, dtype=dtype, shape=list(tensor.shape), bytes=storage.nbytes()
                )
            )
    return found


def layer_saved_tensors(name: str, spec: str, args, batch: int = 2) -> dict:
    """What one vision encoder layer saves for backward, per token (bf16 autocast, SDPA attention)."""
    from transformers.models.clip.modeling_clip import CLIPEncoderLayer

    from hf_switchback import apply_switchback

    base, _, budget, compiled, _ = parse_variant(spec)
    config = bench_train.clip_config(name, tiny=args.tiny).vision_config
    config._attn_implementation = "sdpa"
    with torch.device(args.device):
        layer = CLIPEncoderLayer(config).train()
    if bench_train.switchback_fields(base) is not None:
        # min_tokens=0: the layer alone sees few tokens; the 8-bit path must run to be measured
        apply_switchback(layer, bench_train.switchback_config(base, min_tokens=0))
    elif base != "bf16":
        raise ValueError(f"--saved_tensors takes bf16 or SwitchBack variants, got {spec!r}")
    seq = (config.image_size // config.patch_size) ** 2 + 1
    tokens = batch * seq
    x = torch.randn(batch, seq, config.hidden_size, device=args.device, requires_grad=True)
    with common.recompute_budget(budget), torch.autocast(args.device, dtype=torch.bfloat16):
        if compiled:
            layer.compile(dynamic=False)
        out = layer(x, None)
        out = out[0] if isinstance(out, tuple) else out
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    # tensors led by the batch or token dimension are activations; the rest is per-layer constant
    found = [t for t in saved_by_graph(out, params) if t["shape"] and t["shape"][0] in (batch, tokens)]
    for t in found:
        t["bytes_per_token"] = t.pop("bytes") / tokens
    del out, layer, x
    bench_train.cleanup(args.device)
    total = sum(t["bytes_per_token"] for t in found)
    return dict(model=name, variant=spec, width=config.hidden_size, bytes_per_token=total, tensors=found)


def print_saved(reports: list[dict]) -> None:
    for r in reports:
        per_d = r["bytes_per_token"] / r["width"]
        print(f"{r['model']} {r['variant']}: {r['bytes_per_token']:.0f} bytes/token/layer ({per_d:.2f} x d)")
        for t in sorted(r["tensors"], key=lambda t: -t["bytes_per_token"]):
            print(
                f"    {t['bytes_per_token']:8.0f}  {t['dtype']:14} {t['node']:40} {t['attr']:16} {t['shape']}"
            )


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
    cap = 0
    if args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        cap = int(args.mem_cap_gib * GIB) if args.mem_cap_gib else total
        if cap < total:  # out of memory at the cap, not at the card's size
            torch.cuda.set_per_process_memory_fraction(cap / total)
        env["mem_cap_gib"] = cap / GIB
    print(json.dumps(env), flush=True)
    if args.saved_tensors:
        reports = [layer_saved_tensors(name, spec, args) for name in args.models for spec in args.variants]
        if args.json:
            Path(args.json).write_text(json.dumps(dict(env=env, saved_tensors=reports), indent=1))
        print_saved(reports)
        return reports
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=bench_train.RAW)
    bench_train.add_row_flags(parser, DEFAULT_VARIANTS, steps=4, warmup=1)
    parser.set_defaults(models=["vit-h-14"])
    parser.add_argument("--mem_cap_gib", type=float, default=None, help="memory cap (default: the GPU's)")
    parser.add_argument("--fit", choices=("estimate", "search"), default="estimate", help="see above")
    spec_list = dict(nargs="+", type=bench_train.spec_arg, metavar="SPEC")
    parser.add_argument("--fit_variants", **spec_list, help="rows --fit search runs for (default: all)")
    parser.add_argument("--fit_tries", type=int, default=3, help="runs per row that --fit may add")
    parser.add_argument(
        "--batch_multiple", type=int, default=8, help="batches --fit tries are multiples of this"
    )
    parser.add_argument("--profile_variants", **spec_list, help="rows --profile profiles (default: all)")
    parser.add_argument(
        "--saved_tensors", action="store_true", help="per-tensor saved bytes instead (see above)"
    )
    args = parser.parse_args()
    common.check_device(parser, args)
    run(args)


if __name__ == "__main__":
    main()
