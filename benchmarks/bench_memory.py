"""Memory: how large a per-GPU CLIP batch each training configuration fits, and how fast it trains there.

Contrastive training wants the largest per-GPU batch. bf16 reaches it by recomputing activations (gradient
checkpointing, or torch.compile's `activation_memory_budget` selective recompute); SwitchBack's memory switch
(`memory_efficient`, with `fuse_mlp`) saves activations in 8 bits instead. Each row trains one HF CLIPModel from
examples/configs/ on random data (the model and step of benchmarks/bench_train.py: bf16 autocast, contrastive
loss, fused AdamW), reports samples/s, the peak memory, the memory the forward leaves saved for backward, and the
largest batch that fits the memory cap. One process, one table; each finished row is printed as one JSON line
and rewritten to --json at once.

    PYTHONPATH=src python benchmarks/bench_memory.py --models vit-h-14 --batch 192 --variants \\
        bf16+ckpt+compile bf16+budget0.5+compile int8-memeff+compile int8-memeff-unfused+budget0.8+compile \\
        bf16+compile@128 --fit search --fit_variants bf16+compile@128 --profile $OUT/prof --json $OUT/mem.json
    PYTHONPATH=src python benchmarks/bench_memory.py --device cpu --tiny --variants bf16 int8-memeff  # smoke

Variants: BASE[+MODIFIER...][@B]
  BASE            every base of bench_train.py:
    bf16                      bf16 autocast, nn.Linear
    int8, fp8, ...            SwitchBack with the library defaults (and bench_train.py's other SwitchBack rows)
    int8-memeff, fp8-memeff   the memory switch, SwitchBackConfig(memory_efficient=True): 8-bit saved inputs,
                              each CLIP MLP fused with its fc1 output recomputed in backward; -memeff-fused
                              says so explicitly, -memeff-unfused keeps separate MLP layers (fc1's output saved)
    torchao-float8-tensorwise, torchao-float8-rowwise, torchao-float8-rowwise_with_gw_hp
                              torchao's float8 training recipes on the encoder linears, for reference; recorded
                              as skipped, with the reason, where torchao is not installed
  +ckpt, +budgetF, +compile, @B   the row grammar of benchmarks/common.py; +compile compiles the whole model
                  (--compile model, the default; --compile layers: each encoder layer)
  Examples: bf16+ckpt+compile, bf16+budget0.5+compile, int8-memeff+compile, fp8-memeff-unfused+budget0.8+compile,
  torchao-float8-rowwise+compile.

Largest batch (`--fit`, for the rows in --fit_variants, default all):
  estimate  (default) from the row's own run: peak(batch) = fixed + batch x per-sample, fixed = the memory
            between steps (parameters, optimizer state) + the gradients (one per parameter). Everything else
            is counted as growing with the batch, so the estimate errs low (the bf16 weight copies and
            workspaces do not grow). No extra runs.
  verify    the estimate, then a run at that batch (rounded down to --batch_multiple), stepping down 5% per
            out-of-memory, at most --fit_tries runs.
  search    a run at the estimate, then bisection between the largest batch that fit and the smallest that
            did not (1.25x the estimate until one fails), out-of-memory caught, at most --fit_tries runs.
Each run of a compiled row at a new batch compiles again (the new shape recompiles the graphs).

--profile DIR: after a row's figures, torch.profiler over --profile_steps more steps: GPU ms per step by
kernel family (16-bit GEMM, 8-bit GEMM, quantize/cast, attention, norm + elementwise, optimizer, other) and phase
(forward, backward), and the recompute seen (attention forward kernels in backward, backward GEMMs beyond two per
forward GEMM); benchmarks/step_profile.py says how each is told apart.

--profile_variants SPEC...: profile only these rows (default: all); --fit runs are never profiled.

Needs CUDA except for the --device cpu smoke mode (no memory figures there).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train
import common
import step_profile

DEFAULT_VARIANTS = (
    "bf16+compile",
    "bf16+ckpt+compile",
    "bf16+budget0.5+compile",
    "int8-memeff-fused+compile",
    "fp8-memeff-fused+compile",
    "torchao-float8-rowwise+compile",
)
GIB = 2**30
parse_variant = bench_train.parse_variant


def missing_requirement(base: str) -> str | None:
    """Why a row cannot run here (None: it can): torchao rows need torchao, an optional reference."""
    if base.startswith("torchao-") and importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao; on the GPU machine carry it as a wheel)"
    return None


def run_row(name: str, spec: str, batch: int, args: argparse.Namespace, profile: bool = False) -> dict:
    """Train `steps` steps of one configuration at one batch: speed and memory (CUDA), or a smoke run (CPU);
    with `profile`, then profile --profile_steps more steps (after the figures, so they do not enter them)."""
    device = args.device
    base, grad_ckpt, budget, compiled, _ = parse_variant(spec)
    config = bench_train.clip_config(name, tiny=args.tiny)
    cuda = device == "cuda"
    with common.recompute_budget(budget):
        model = bench_train.build_model(
            config, base + ("+compile" if compiled else ""), grad_ckpt, args.compile, device
        )
        forward, finish = bench_train.training_step(model, config, batch, device)
        t0 = time.perf_counter()
        finish(forward())
        bench_train.synchronize(device)
        first_step_s = time.perf_counter() - t0
        for _ in range(args.warmup):
            finish(forward())
        bench_train.synchronize(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        resting = torch.cuda.memory_allocated() if cuda else 0
        loss = forward()  # one step split in two: what the forward leaves saved for backward
        bench_train.synchronize(device)
        saved = torch.cuda.memory_allocated() - resting if cuda else 0
        finish(loss)
        ms, loss = bench_train.timed_steps(lambda: finish(forward()), args.steps, device)
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        row = dict(
            model=name,
            variant=spec,
            batch=batch,
            ms_per_step=ms,
            samples_per_s=batch * 1000 / ms,
            first_step_s=first_step_s,
            loss=loss.item(),
        )
        if cuda:
            grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            fixed = resting + grad_bytes
            row.update(
                peak_gib=peak / GIB,
                resting_gib=resting / GIB,
                saved_gib=saved / GIB,
                saved_mib_per_sample=saved / batch / 2**20,
                fixed_gib=fixed / GIB,
                peak_mib_per_sample=(peak - fixed) / batch / 2**20,
            )
        if profile:
            path = Path(args.profile) / f"{name}_{spec.partition('@')[0].replace('+', '_')}_b{batch}.txt"
            title = (
                f"{name} {spec} batch {batch}: {args.profile_steps} steps profiled, timed {ms:.1f} ms/step"
            )
            try:
                row["profile"] = step_profile.profile_row(
                    forward, finish, args.profile_steps, device, path, title
                )
            except Exception as err:  # a profiler failure must not lose the row's figures
                row["profile_error"] = repr(err)[:300]
    return row


def estimate_max_batch(row: dict, cap: int) -> int | None:
    """Largest batch under `cap` bytes by peak = fixed + batch x per-sample (see --fit estimate)."""
    per_sample = row.get("peak_mib_per_sample")
    if not per_sample or per_sample <= 0:
        return None
    return max(0, math.floor((cap / GIB - row["fixed_gib"]) * 1024 / per_sample))


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


class Clock:
    """--time_budget_s: a run starts only if the longest run so far of the same model would still end in time."""

    def __init__(self, budget_s: float | None):
        self.start, self.budget_s, self.longest = time.perf_counter(), budget_s, {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, model: str) -> bool:
        return not self.budget_s or self.elapsed() + self.longest.get(model, 0.0) <= self.budget_s

    def record(self, model: str, seconds: float) -> None:
        self.longest[model] = max(self.longest.get(model, 0.0), seconds)


def attempt(
    name: str,
    spec: str,
    batch: int,
    args: argparse.Namespace,
    clock: Clock | None = None,
    profile: bool = False,
) -> dict:
    """run_row, with a failure (out of memory above all) recorded in the row instead of raised, and a row that
    cannot run here (torchao missing) or would overrun --time_budget_s recorded as skipped."""
    reason = missing_requirement(parse_variant(spec).base)
    if reason is None and clock is not None and not clock.allows(name):
        reason = f"time budget ({clock.elapsed():.0f} s used)"
    if reason is not None:
        return dict(model=name, variant=spec, batch=batch, status="skipped", error=reason)
    t0 = time.perf_counter()
    try:
        row = run_row(name, spec, batch, args, profile)
    except Exception as err:  # one failing row must not lose the rest of the table
        row = dict(model=name, variant=spec, batch=batch, status="oom" if is_oom(err) else "error")
        row["error"] = repr(err)[:300]
    bench_train.cleanup(args.device)  # after the except block, so the traceback no longer pins the model
    row["run_s"] = time.perf_counter() - t0
    if clock is not None:
        clock.record(name, row["run_s"])
    return row


def fit(
    name: str,
    spec: str,
    first: dict,
    args: argparse.Namespace,
    cap: int,
    mode: str | None = None,
    clock: Clock | None = None,
) -> dict:
    """The largest batch found for one configuration (see --fit; `mode` overrides args.fit); `first` is its
    run at the row's batch."""
    mode = mode or args.fit
    estimate = estimate_max_batch(first, cap) if "ms_per_step" in first else None
    out = dict(max_batch_est=estimate)
    if mode == "estimate" or estimate is None:
        return out
    step = args.batch_multiple
    runs = []

    def run_at(batch: int) -> bool:
        """One run at `batch`; True if it fits. A skipped run (time budget) ends the search."""
        row = attempt(name, spec, batch, args, clock)
        runs.append(row)
        if "ms_per_step" in row:
            out.update(max_batch=batch, max_batch_samples_per_s=row["samples_per_s"])
        return "ms_per_step" in row

    if mode == "verify":
        batch = estimate // step * step
        for _ in range(args.fit_tries):
            if batch <= 0 or run_at(batch) or runs[-1].get("status") == "skipped":
                break
            batch = int(batch * 0.95) // step * step
    else:  # search: the estimate first, then bisection between a batch that fits and one that does not
        # (the estimate errs low: 1.25x it is assumed not to fit until a run says otherwise)
        ok, bad = first["batch"], max(math.ceil(1.25 * estimate / step) * step, first["batch"] + step)
        out.update(max_batch=ok, max_batch_samples_per_s=first["samples_per_s"], search_upper=bad)
        batch = estimate // step * step
        for _ in range(args.fit_tries):
            if not ok < batch < bad:
                batch = (ok + bad) // 2 // step * step
            if batch <= ok:
                break
            if run_at(batch):
                ok = batch
            elif runs[-1].get("status") == "skipped":
                break
            else:
                bad = batch
            batch = (ok + bad) // 2 // step * step
        out["oom_at"] = bad if bad != out["search_upper"] else None
    keys = ("batch", "status", "samples_per_s", "peak_gib", "run_s")
    out["fit_runs"] = [{k: r.get(k) for k in keys} for r in runs]
    return out


def saved_by_graph(output: torch.Tensor, params: set[int]) -> list[dict]:
    """Every tensor the autograd graph behind `output` holds for backward, once per storage.

    Reads each node's saved tensors (`_saved_*` attributes of built-in nodes, `saved_tensors` of custom
    functions and of torch.compile's CompiledFunction), so under compile it lists what the partitioner kept.
    Storages of `params` (data_ptr) are left out: they are the layer's weights, not activations.
    """
    seen, found, stack, visited = set(), [], [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        stack.extend(fn for fn, _ in node.next_functions)
        held = []
        for attr in dir(node):
            if attr.startswith("_saved_"):
                with contextlib.suppress(Exception):  # some attributes are freed or not tensors
                    held.append((attr, getattr(node, attr)))
        with contextlib.suppress(Exception):
            held += [("saved_tensors", t) for t in node.saved_tensors]
        for attr, value in held:
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
                    continue
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key in seen or key in params:
                    continue
                seen.add(key)
                found.append(
                    dict(
                        node=node.name(),
                        attr=attr,
                        dtype=str(tensor.dtype).removeprefix("torch."),
                        shape=list(tensor.shape),
                        bytes=storage.nbytes(),
                    )
                )
    return found


def layer_saved_tensors(name: str, spec: str, args: argparse.Namespace, batch: int = 2) -> dict:
    """What one vision encoder layer saves for backward, per token (bf16 autocast, SDPA attention)."""
    from transformers.models.clip.modeling_clip import CLIPEncoderLayer

    from hf_switchback import apply_switchback

    base, _, budget, compiled, _ = parse_variant(spec)
    device = args.device
    config = bench_train.clip_config(name, tiny=args.tiny).vision_config
    config._attn_implementation = "sdpa"
    with torch.device(device):
        layer = CLIPEncoderLayer(config).train()
    if base in bench_train.SWITCHBACK_VARIANTS:
        # min_tokens=0: the layer alone sees few tokens; the 8-bit path must run to be measured
        apply_switchback(layer, bench_train.switchback_config(base, min_tokens=0))
    elif base != "bf16":
        raise ValueError(f"--saved_tensors takes bf16 or SwitchBack variants, got {spec!r}")
    seq = (config.image_size // config.patch_size) ** 2 + 1
    tokens = batch * seq
    x = torch.randn(batch, seq, config.hidden_size, device=device, requires_grad=True)
    with common.recompute_budget(budget), torch.autocast(device, dtype=torch.bfloat16):
        if compiled:
            layer.compile(dynamic=False)
        out = layer(x, None)
        out = out[0] if isinstance(out, tuple) else out
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    found = [t for t in saved_by_graph(out, params) if t["shape"] and t["shape"][0] in (batch, tokens)]
    for (
        t
    ) in found:  # tensors led by the batch or token dimension: activations; the rest is per-layer constant
        t["bytes_per_token"] = t.pop("bytes") / tokens
    total = sum(t["bytes_per_token"] for t in found)
    del out, layer, x
    bench_train.cleanup(device)
    return dict(model=name, variant=spec, width=config.hidden_size, bytes_per_token=total, tensors=found)


def print_saved(reports: list[dict]) -> None:
    for r in reports:
        d = r["width"]
        print(
            f"{r['model']} {r['variant']}: {r['bytes_per_token']:.0f} bytes/token/layer "
            f"({r['bytes_per_token'] / d:.2f} x d)"
        )
        for t in sorted(r["tensors"], key=lambda t: -t["bytes_per_token"]):
            print(
                f"    {t['bytes_per_token']:8.0f}  {t['dtype']:14} {t['node']:40} {t['attr']:16} {t['shape']}"
            )


def print_table(rows: list[dict]) -> None:
    best: dict = {}  # the fastest bf16 row that recomputes, per (model, batch)
    plain: dict = {}  # bf16 + compile without recompute, per (model, batch)
    for r in rows:
        v = parse_variant(r["variant"])
        key = (r["model"], r["batch"])
        if "samples_per_s" in r and v.base == "bf16" and (v.grad_ckpt or v.budget is not None):
            best[key] = max(best.get(key, 0.0), r["samples_per_s"])
        elif "samples_per_s" in r and v.base == "bf16" and v.compiled:
            plain[key] = r["samples_per_s"]
    header = (
        f"{'model':9} {'variant':40} {'batch':>5} {'ms/step':>8} {'samples/s':>9} {'x bf16 rec':>10} {'x bf16+c':>8} "
        f"{'peak GiB':>8} {'saved MiB/s':>11} {'max b est':>9} {'max b':>6} {'1st s':>6}"
    )
    common.print_header(header)
    for r in rows:
        lead = f"{r['model']:9} {r['variant']:40} {r['batch']:5}"
        if "ms_per_step" not in r:
            print(f"{lead} {r.get('status', 'error')}: {r.get('error', '')[:100]}")
            continue
        ratio = common.ratio(r["samples_per_s"], best.get((r["model"], r["batch"])))
        ratio_plain = common.ratio(r["samples_per_s"], plain.get((r["model"], r["batch"])))
        mem = (
            f"{r['peak_gib']:8.1f} {r['saved_mib_per_sample']:11.1f}"
            if "peak_gib" in r
            else f"{'-':>8} {'-':>11}"
        )
        est = r.get("max_batch_est")
        print(
            f"{lead} {r['ms_per_step']:8.1f} {r['samples_per_s']:9.1f} {ratio:>10} {ratio_plain:>8} {mem} "
            f"{est if est is not None else '-':>9} {r.get('max_batch', '-')!s:>6} {r['first_step_s']:6.1f}"
        )
    print(
        "x bf16 rec: samples/s over the fastest bf16 row with recompute (+ckpt or +budget) at the same batch; "
        "x bf16+c: over bf16+compile (no recompute) at the same batch"
    )
    step_profile.print_profiles(rows)


def row_batch(name: str, spec: str, args: argparse.Namespace) -> int:
    """@B of the spec, else --batch, else the model's default (bench_train.MODELS; TINY_BATCH with --tiny)."""
    batch = parse_variant(spec).batch or args.batch
    return batch or (bench_train.TINY_BATCH if args.tiny else bench_train.MODELS[name]["batch"])


def run(args: argparse.Namespace) -> list[dict]:
    env = bench_train.environment(args)
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
    rows: list[dict] = []
    clock = Clock(args.time_budget_s)
    for name in args.models:
        for spec in args.variants:
            t0 = clock.elapsed()
            profile = bool(args.profile) and (not args.profile_variants or spec in args.profile_variants)
            row = attempt(name, spec, row_batch(name, spec, args), args, clock, profile)
            if args.device == "cuda" and row.get("status") != "skipped":
                fitting = not args.fit_variants or spec in args.fit_variants
                row.update(fit(name, spec, row, args, cap, args.fit if fitting else "estimate", clock))
            row["row_s"] = clock.elapsed() - t0
            rows.append(row)
            common.emit(rows, env, args.json)
    print_table(rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", choices=list(bench_train.MODELS), default=["vit-h-14"], help="CLIP sizes"
    )
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), help="rows (see above)")
    parser.add_argument(
        "--batch", type=int, default=None, help="per-GPU batch of every row (default: per model)"
    )
    parser.add_argument(
        "--compile",
        choices=("model", "layers"),
        default="model",
        help="what +compile rows compile: the whole model (default) or each encoder layer",
    )
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (compile) step")
    parser.add_argument("--mem_cap_gib", type=float, default=None, help="memory cap (default: the GPU's)")
    parser.add_argument(
        "--fit",
        choices=("estimate", "verify", "search"),
        default="estimate",
        help="largest batch (see above)",
    )
    parser.add_argument(
        "--fit_variants",
        nargs="+",
        default=None,
        metavar="SPEC",
        help="rows (as written in --variants) that --fit verify/search runs for; the others estimate "
        "(default: all rows)",
    )
    parser.add_argument("--fit_tries", type=int, default=3, help="runs per row that --fit may add")
    parser.add_argument(
        "--batch_multiple", type=int, default=8, help="batches --fit tries are multiples of this"
    )
    parser.add_argument(
        "--time_budget_s",
        type=float,
        default=None,
        help="skip a run (row or --fit try) that would end past this many seconds, judged by the longest run "
        "of the same model so far",
    )
    parser.add_argument(
        "--json", default=None, help="also write the rows to this JSON file (after every row)"
    )
    parser.add_argument(
        "--saved_tensors",
        action="store_true",
        help="instead of training: list what one vision encoder layer saves for backward, bytes per token",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after each row's figures, profile --profile_steps more steps: GPU ms by kernel family and phase "
        "in the row's JSON and the printed table, the full report in DIR/<model>_<variant>_b<batch>.txt "
        "(benchmarks/step_profile.py; on the CPU the report lists CPU ops, a smoke test)",
    )
    parser.add_argument(
        "--profile_variants",
        nargs="+",
        default=None,
        metavar="SPEC",
        help="rows (as written in --variants) that --profile profiles (default: all rows; never the --fit runs)",
    )
    parser.add_argument("--profile_steps", type=int, default=2, help="steps profiled per row with --profile")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke test only")
    parser.add_argument("--tiny", action="store_true", help="shrink the models to CPU-test size (smoke test)")
    args = parser.parse_args()
    for spec in args.variants + (args.fit_variants or []) + (args.profile_variants or []):
        try:
            parse_variant(spec)
        except ValueError as err:
            parser.error(str(err))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_memory.py needs a CUDA GPU (or --device cpu --tiny for a smoke test)")
    run(args)


if __name__ == "__main__":
    main()
