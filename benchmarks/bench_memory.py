"""Memory: how large a per-GPU CLIP batch each training configuration fits, and how fast it trains there.

Contrastive training wants the largest per-GPU batch. bf16 reaches it by recomputing activations (gradient
checkpointing, or torch.compile's `activation_memory_budget` selective recompute); SwitchBack's memory switch
(`memory_efficient`, with `fuse_mlp`) saves activations in 8 bits instead. Each row trains one HF CLIPModel from
examples/configs/ on random data (the model and step of benchmarks/bench_train.py: bf16 autocast, contrastive
loss, fused AdamW), reports samples/s, the peak memory, the memory the forward leaves saved for backward, and the
largest batch that fits the memory cap. One process, one table; each finished row is printed as one JSON line
and rewritten to --json at once.

    PYTHONPATH=src python benchmarks/bench_memory.py --models vit-h-14 --batch 192 --variants \
        bf16+compile bf16+ckpt+compile bf16+budget0.5+compile int8-memeff-fused+compile --json $OUT/mem.json
    PYTHONPATH=src python benchmarks/bench_memory.py --device cpu --tiny --variants bf16 int8-memeff  # smoke

Variants: a base, then modifiers joined by '+':
  bf16, int8, fp8, int8-memeff, fp8-memeff, int8-memeff-unfused, torchao-float8-<recipe>, ...
                  (every base of bench_train.py; -memeff = SwitchBackConfig(memory_efficient=True), the memory
                  switch, which fuses each CLIP MLP too; -memeff-fused says so explicitly, -memeff-unfused keeps
                  separate MLP layers)
  +ckpt           full gradient checkpointing of every encoder layer (HF gradient_checkpointing_enable)
  +budgetF        torch._functorch.config.activation_memory_budget = F (0..1) while the row compiles: Inductor's
                  partitioner recomputes cheap ops so that at most F of the activations are saved (needs
                  +compile)
  +compile        each encoder layer compiled (bench_train.py --compile layers)

Largest batch (`--fit`):
  estimate  (default) from the row's own run: peak(batch) = fixed + batch x per-sample, fixed = the memory
            between steps (parameters, optimizer state) + the gradients (one per parameter). Everything else
            is counted as growing with the batch, so the estimate errs low (the bf16 weight copies and
            workspaces do not grow). No extra runs.
  verify    the estimate, then a run at that batch (rounded down to --batch_multiple), stepping down 5% per
            out-of-memory, at most --fit_tries runs.
  search    bisection between the row's batch and 2x the estimate, OOM caught, at most --fit_tries runs.
Each run of a compiled row at a new batch compiles again (the layers are compiled with dynamic=False).

Needs CUDA except for the --device cpu smoke mode (no memory figures there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train

DEFAULT_VARIANTS = (
    "bf16+compile",
    "bf16+ckpt+compile",
    "bf16+budget0.5+compile",
    "int8-memeff-fused+compile",
    "fp8-memeff-fused+compile",
)
MODIFIERS = ("ckpt", "compile")
GIB = 2**30


def parse_variant(spec: str) -> tuple[str, bool, float | None, bool]:
    """'bf16+budget0.5+compile' -> (base 'bf16', checkpointing False, budget 0.5, compiled True)."""
    base, *mods = spec.split("+")
    if base not in bench_train.BASES:
        raise ValueError(f"unknown base {base!r} in {spec!r}; choose from {bench_train.BASES}")
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
    return base, "ckpt" in mods, budget, compiled


def recompute_budget(budget: float | None):
    """Context in which torch.compile partitions the layers under `budget` (None: the default, 1.0)."""
    if budget is None:
        return contextlib.nullcontext()
    return torch._functorch.config.patch(activation_memory_budget=budget)


def run_row(name: str, spec: str, batch: int, args: argparse.Namespace) -> dict:
    """Train `steps` steps of one configuration at one batch: speed and memory (CUDA), or a smoke run (CPU)."""
    device = args.device
    base, grad_ckpt, budget, compiled = parse_variant(spec)
    config = bench_train.clip_config(name, tiny=args.tiny)
    cuda = device == "cuda"
    with recompute_budget(budget):
        model = bench_train.build_model(
            config, base + ("+compile" if compiled else ""), grad_ckpt, "layers", device
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
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = finish(forward())
        bench_train.synchronize(device)
        ms = (time.perf_counter() - t0) * 1000 / args.steps
    if not torch.isfinite(loss).item():
        raise FloatingPointError(f"loss is {loss.item()}")
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
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
        peak = torch.cuda.max_memory_allocated()
        fixed = resting + grad_bytes
        row.update(
            peak_gib=peak / GIB,
            resting_gib=resting / GIB,
            saved_gib=saved / GIB,
            saved_mib_per_sample=saved / batch / 2**20,
            fixed_gib=fixed / GIB,
            peak_mib_per_sample=(peak - fixed) / batch / 2**20,
        )
    return row


def estimate_max_batch(row: dict, cap: int) -> int | None:
    """Largest batch under `cap` bytes by peak = fixed + batch x per-sample (see --fit estimate)."""
    per_sample = row.get("peak_mib_per_sample")
    if not per_sample or per_sample <= 0:
        return None
    return max(0, math.floor((cap / GIB - row["fixed_gib"]) * 1024 / per_sample))


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def attempt(name: str, spec: str, batch: int, args: argparse.Namespace) -> dict:
    """run_row, with a failure (out of memory above all) recorded in the row instead of raised."""
    try:
        row = run_row(name, spec, batch, args)
    except Exception as err:  # one failing row must not lose the rest of the table
        row = dict(model=name, variant=spec, batch=batch, status="oom" if is_oom(err) else "error")
        row["error"] = repr(err)[:300]
    bench_train.cleanup(args.device)  # after the except block, so the traceback no longer pins the model
    return row


def fit(name: str, spec: str, first: dict, args: argparse.Namespace, cap: int) -> dict:
    """The largest batch found for one configuration (see --fit); `first` is its run at --batch."""
    estimate = estimate_max_batch(first, cap) if "ms_per_step" in first else None
    out = dict(max_batch_est=estimate)
    if args.fit == "estimate" or estimate is None:
        return out
    step = args.batch_multiple
    runs = []
    if args.fit == "verify":
        batch = estimate // step * step
        for _ in range(args.fit_tries):
            if batch <= 0:
                break
            row = attempt(name, spec, batch, args)
            runs.append(row)
            if "ms_per_step" in row:
                out.update(max_batch=batch, max_batch_samples_per_s=row["samples_per_s"])
                break
            batch = int(batch * 0.95) // step * step
    else:  # bisection between a batch known to fit and one known (or assumed) not to
        ok, bad = first["batch"], max(2 * estimate, first["batch"] + step)
        out.update(max_batch=ok, max_batch_samples_per_s=first["samples_per_s"])
        for _ in range(args.fit_tries):
            batch = (ok + bad) // 2 // step * step
            if batch <= ok:
                break
            row = attempt(name, spec, batch, args)
            runs.append(row)
            if "ms_per_step" in row:
                ok = batch
                out.update(max_batch=batch, max_batch_samples_per_s=row["samples_per_s"])
            else:
                bad = batch
    out["fit_runs"] = [{k: r.get(k) for k in ("batch", "status", "samples_per_s", "peak_gib")} for r in runs]
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

    from hf_switchback import SwitchBackConfig, apply_switchback

    base, _, budget, compiled = parse_variant(spec)
    device = args.device
    config = bench_train.clip_config(name, tiny=args.tiny).vision_config
    config._attn_implementation = "sdpa"
    with torch.device(device):
        layer = CLIPEncoderLayer(config).train()
    if base in bench_train.SWITCHBACK_VARIANTS:
        # min_tokens=0: the layer alone sees few tokens; the 8-bit path must run to be measured
        apply_switchback(layer, SwitchBackConfig(**bench_train.SWITCHBACK_VARIANTS[base], min_tokens=0))
    elif base != "bf16":
        raise ValueError(f"--saved_tensors takes bf16 or SwitchBack variants, got {spec!r}")
    seq = (config.image_size // config.patch_size) ** 2 + 1
    tokens = batch * seq
    x = torch.randn(batch, seq, config.hidden_size, device=device, requires_grad=True)
    with recompute_budget(budget), torch.autocast(device, dtype=torch.bfloat16):
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
    for r in rows:
        base, grad_ckpt, budget, _ = parse_variant(r["variant"])
        if "samples_per_s" in r and base == "bf16" and (grad_ckpt or budget is not None):
            key = (r["model"], r["batch"])
            best[key] = max(best.get(key, 0.0), r["samples_per_s"])
    header = (
        f"{'model':9} {'variant':32} {'batch':>5} {'ms/step':>8} {'samples/s':>9} {'x bf16 rec':>10} "
        f"{'peak GiB':>8} {'saved MiB/s':>11} {'max b est':>9} {'max b':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        lead = f"{r['model']:9} {r['variant']:32} {r['batch']:5}"
        if "ms_per_step" not in r:
            print(f"{lead} {r.get('status', 'error')}: {r.get('error', '')[:80]}")
            continue
        ref = best.get((r["model"], r["batch"]))
        ratio = f"{r['samples_per_s'] / ref:.2f}x" if ref else "-"
        mem = (
            f"{r['peak_gib']:8.1f} {r['saved_mib_per_sample']:11.1f}"
            if "peak_gib" in r
            else f"{'-':>8} {'-':>11}"
        )
        est = r.get("max_batch_est")
        print(
            f"{lead} {r['ms_per_step']:8.1f} {r['samples_per_s']:9.1f} {ratio:>10} {mem} "
            f"{est if est is not None else '-':>9} {r.get('max_batch', '-')!s:>6}"
        )
    print(
        "x bf16 rec: samples/s over the fastest bf16 row with recompute (+ckpt or +budget) at the same batch"
    )


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
    start = time.perf_counter()
    for name in args.models:
        batch = args.batch or (bench_train.TINY_BATCH if args.tiny else bench_train.MODELS[name]["batch"])
        for spec in args.variants:
            elapsed = time.perf_counter() - start
            if args.time_budget_s and elapsed > args.time_budget_s:
                row = dict(model=name, variant=spec, batch=batch, status="skipped")
                row["error"] = f"time budget ({elapsed:.0f} s used)"
            else:
                row = attempt(name, spec, batch, args)
                if args.device == "cuda":
                    row.update(fit(name, spec, row, args, cap))
                row["row_s"] = time.perf_counter() - start - elapsed
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(dict(env=env, rows=rows), indent=1))
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
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (compile) step")
    parser.add_argument("--mem_cap_gib", type=float, default=None, help="memory cap (default: the GPU's)")
    parser.add_argument("--fit", choices=("estimate", "verify", "search"), default="estimate")
    parser.add_argument("--fit_tries", type=int, default=3, help="runs per row that --fit may add")
    parser.add_argument(
        "--batch_multiple", type=int, default=8, help="batches --fit tries are multiples of this"
    )
    parser.add_argument("--time_budget_s", type=float, default=None, help="skip rows started past this time")
    parser.add_argument(
        "--json", default=None, help="also write the rows to this JSON file (after every row)"
    )
    parser.add_argument(
        "--saved_tensors",
        action="store_true",
        help="instead of training: list what one vision encoder layer saves for backward, bytes per token",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke test only")
    parser.add_argument("--tiny", action="store_true", help="shrink the models to CPU-test size (smoke test)")
    args = parser.parse_args()
    for spec in args.variants:
        try:
            parse_variant(spec)
        except ValueError as err:
            parser.error(str(err))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_memory.py needs a CUDA GPU (or --device cpu --tiny for a smoke test)")
    run(args)


if __name__ == "__main__":
    main()
