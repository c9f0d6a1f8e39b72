"""Compile warm-up of a training step, each variant in fresh processes: from empty caches, then again on them.

What a user pays before the first optimizer step of a compiled run. Rows of one process share Inductor's and
Triton's caches (bench_train.py's "1st step s" of a later row is flattered by an earlier one), so here every
(model, variant) gets its own cache folders (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) and two processes of
`bench_train.py`, one row each:

    cold   empty caches: a first run on a machine
    warm   the same caches again: a resumed or repeated run
    moved  (--moved) new empty caches plus the compile artifacts the cold process saved
           (hf_switchback.compile_cache): a run on another machine, as train_clip.py --compile_cache_dir does

Per row: the first step's wall time, its ratio to the --baseline variant of the same model and pass, and where it
went (benchmarks/common.py): compiling the forward and backward graphs (of which waiting for Inductor's
parallel kernel compiles) and running the step, which on its first call also autotunes and JIT-compiles kernels;
and how many of its graphs Inductor's FX graph cache loaded, compiled, or could not cache (hit/miss/bypass).
An untimed eager process runs first (--no_prime skips it) so that reading the libraries from disk on a fresh
machine does not land on the first row; --repeats N measures every row N times on new caches (compile times of
one process vary by seconds).

    PYTHONPATH=src python benchmarks/compile_warmup.py --models vit-b-16 --variants bf16+compile int8+compile \\
        --json $OUT/warmup.json
    # any flag it does not know goes to bench_train.py, e.g. the GEMM as an opaque op under compile:
    PYTHONPATH=src python benchmarks/compile_warmup.py --variants int8+compile --opaque_gemm_under_compile
    # and a third process per row on another machine's caches: empty, plus the artifacts the cold one saved
    PYTHONPATH=src python benchmarks/compile_warmup.py --variants bf16+compile int8+compile --compile layers --moved
    PYTHONPATH=src python benchmarks/compile_warmup.py --device cpu --tiny --variants bf16 int8  # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402

PASSES = ("cold", "warm")


def run_row(model: str, variant: str, cache: Path, args: argparse.Namespace, extra: list[str]) -> dict:
    """One bench_train.py process for one row, on the caches under `cache`; its JSON row (or the error)."""
    out = cache / f"row_{time.monotonic_ns()}.json"
    env = dict(
        os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton")
    )
    command = [
        sys.executable,
        str(HERE / "bench_train.py"),
        *("--models", model, "--variants", variant),
        *("--steps", str(args.steps), "--warmup", str(args.warmup), "--json", str(out)),
        *(["--batch", str(args.batch)] if args.batch else []),
        *(["--device", "cpu", "--tiny"] if args.tiny else ["--device", args.device]),
        *extra,
    ]
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        return dict(status="error", error=f"timed out after {args.timeout_s} s")
    if proc.returncode != 0 or not out.exists():
        return dict(status="error", error=f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return json.loads(out.read_text())["rows"][0]


def prime(args: argparse.Namespace, extra: list[str], root: Path) -> None:
    """One untimed eager process first: a machine's first process also pays for reading torch, CUDA and
    transformers from disk, which would land on the first row measured (the baseline's, flattering the rest)."""
    run_row(args.models[0], "bf16", root / "prime", args, extra)


def measure(args: argparse.Namespace, extra: list[str]) -> list[dict]:
    root = Path(args.cache_root or tempfile.mkdtemp(prefix="compile_warmup_"))
    if not args.no_prime:
        prime(args, extra, root)
    rows = []
    for repeat in range(args.repeats):
        for model in args.models:
            for variant in args.variants:
                cache = root / f"{model}_{variant.replace('+', '_')}" / f"repeat{repeat}"
                cache.mkdir(parents=True, exist_ok=True)
                artifacts = ["--compile_artifacts", str(cache / "compile_artifacts.bin")]
                for cache_pass in PASSES + (("moved",) if args.moved else ()):
                    # cold writes the artifacts (with --moved), moved reads them on caches of its own; warm
                    # leaves them out (its caches hold every entry already)
                    folder = cache / "moved" if cache_pass == "moved" else cache
                    folder.mkdir(exist_ok=True)
                    more = artifacts if args.moved and cache_pass != "warm" else []
                    row = dict(
                        run_row(model, variant, folder, args, extra + more), model=model, variant=variant
                    )
                    row.update({"pass": cache_pass, "repeat": repeat, "cache": str(folder)})
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.json:
                        Path(args.json).write_text(
                            json.dumps(dict(args=vars(args), extra=extra, rows=rows), indent=1)
                        )
    return rows


def print_table(rows: list[dict], baseline: str) -> None:
    base = {
        (r["model"], r["pass"], r["repeat"]): r["first_step_s"]
        for r in rows
        if r["variant"] == baseline and "first_step_s" in r
    }
    header = (
        f"{'model':9} {'variant':28} {'pass':5} {'rep':>3} {'1st step s':>10} {f'x {baseline}':>18} {'compile fwd':>11} "
        f"{'compile bwd':>11} {'kernel wait':>11} {'run s':>7} {'ms/step':>8} {'graphs hit/miss/bypass':>22}"
    )
    common.print_header(header)
    for r in rows:
        lead = f"{r['model']:9} {r['variant']:28} {r['pass']:5} {r['repeat']:>3}"
        if "first_step_s" not in r:
            print(f"{lead} {r.get('status', 'error')}: {r.get('error', '')}")
            continue
        ratio = common.ratio(r["first_step_s"], base.get((r["model"], r["pass"], r["repeat"])))
        split = r.get("first_step_split") or {}
        phases = " ".join(
            f"{split[k]:11.1f}" if k in split else f"{'-':>11}"
            for k in ("compile_forward_s", "compile_backward_s", "kernel_compile_wait_s")
        )
        run_s = f"{split['run_s']:7.1f}" if "run_s" in split else f"{'-':>7}"
        print(
            f"{lead} {r['first_step_s']:10.1f} {ratio:>18} {phases} {run_s} {r['ms_per_step']:8.1f} "
            f"{graph_cache_outcomes(r.get('first_step_caches') or {}):>22}"
        )


def graph_cache_outcomes(caches: dict) -> str:
    """Inductor's FX graph cache for the first step's graphs, as hit/miss/bypass ('-' without counters)."""
    if not caches:
        return "-"
    return "/".join(str(caches[f"fx_graph_{outcome}"]) for outcome in ("hit", "miss", "bypass"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["vit-b-16"], help="bench_train.py model names")
    parser.add_argument(
        "--variants", nargs="+", default=["bf16+compile", "int8+compile"], help="bench_train.py rows"
    )
    parser.add_argument(
        "--baseline", default=None, help="ratio column's reference (default: the first variant)"
    )
    parser.add_argument("--batch", type=int, default=None, help="per-step batch (default: bench_train.py's)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (the ms/step column)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    parser.add_argument(
        "--cache_root", default=None, help="where each row's cache folders go (default: a temp dir)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every (model, variant) this many times, each on new empty caches (ratios within a repeat)",
    )
    parser.add_argument(
        "--no_prime",
        action="store_true",
        help="skip the untimed eager process that first reads the libraries from disk",
    )
    parser.add_argument(
        "--moved",
        action="store_true",
        help="a third process per row: new empty caches plus the cold process's compile artifacts",
    )
    parser.add_argument("--timeout_s", type=float, default=900, help="per process")
    parser.add_argument("--json", default=None, help="also write the rows here (after every row)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="CPU-test-size models on the CPU (smoke test)")
    args, extra = parser.parse_known_args()
    if args.tiny:
        args.device = "cpu"
    elif args.device == "cpu":
        parser.error("--device cpu needs --tiny (a smoke test: CPU compile times say nothing about the GPU)")
    rows = measure(args, extra)
    print_table(rows, args.baseline or args.variants[0])
    if any("first_step_s" not in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
