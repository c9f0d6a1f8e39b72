"""Accuracy parity: SwitchBack variants against bf16 in paired runs (same init, same batches), 95% t intervals.

Small CLIPs on the graded-shapes task (accuracy/graded_shapes.py): `finetune` pretrains once in bf16, then
fine-tunes per (variant, seed) on a shifted task; `scratch` trains per (variant, seed) from a seeded init.
Variants: bf16, graded_run.py's SwitchBack ones, sim-row / sim-block<N> (all-int8 simulated in torch).
parity.md: per variant the mean paired difference to bf16 (same seed) and its 95% t interval, read against
+-0.5 pp. Recorded commands and results: BENCHMARKS.md, "Accuracy (parity)".

    PYTHONPATH=src python benchmarks/parity.py --protocol scratch --arch small --batch_size 512 \
        --eval_samples 5000 --variants bf16 int8 --seeds 0 1 2 3 4 --parallel 5 --runs_per_process 2 \
        --steps 1000 --warmup 40 --lr 1e-3 --warm --out_dir $OUT/sc --time_budget_s 545
    python benchmarks/parity.py --merge a/parity.json b/parity.json --out_dir merged   # re-summarize, no runs
    PYTHONPATH=src python benchmarks/parity.py --protocol finetune --smoke --out_dir /tmp/p   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # `accuracy` and `common`, however this file is loaded
import common  # noqa: E402
from accuracy.graded_run import ARCHS, SWITCHBACK_FIELDS, train_graded  # noqa: E402
from accuracy.sim_switchback import QUANTIZER  # noqa: E402
from accuracy.summary import write_outputs  # noqa: E402

TASKS = {"pretrain": "pretrain", "finetune": "finetune", "scratch": "all"}  # protocol -> graded_shapes task
WAVE_RESERVE_S = 25  # kept per later wave of processes, so that a slow first wave does not starve them
EVAL_RESERVE_S = 20.0  # steps="auto": time kept for the final eval (and saving) after training
WARM_VARIANTS = ("int8", "fp8", "int8-int8grad")  # --warm: the Triton variants


def variant_arg(variant: str) -> str:
    """--variants: bf16, a SwitchBack variant, or sim-row / sim-block<N>."""
    sim = variant.startswith("sim-") and QUANTIZER.fullmatch(variant.removeprefix("sim-"))
    if not (sim or variant == "bf16" or variant in SWITCHBACK_FIELDS):
        choices = ", ".join(["bf16", *SWITCHBACK_FIELDS, "sim-row", "sim-block<N>"])
        raise argparse.ArgumentTypeError(f"unknown variant {variant!r}; choose from {choices}")
    return variant


def steps_arg(value: str):
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive step count or 'auto', got {value!r}")
    return int(value)


def launch(specs: list[dict], path: Path, timeout_s: float) -> list[dict]:
    """Run `specs` one after another in one child process (one CUDA context and one Triton autotune for all
    of them); their records, a failure record (with its curve so far) for each that did not finish."""
    specs = [dict(s, progress_to=str(path.with_name(f"{s['name']}.out.json"))) for s in specs]
    for s in specs:
        Path(s["progress_to"]).unlink(missing_ok=True)
    path.write_text(json.dumps(specs))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(SCRIPT), "--one_run", str(path), "--out_dir", str(path.parent)]
    t0 = time.perf_counter()
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc = subprocess.Popen(cmd, env=env, **pipes)
    try:
        tail, status = proc.communicate(timeout=max(5.0, timeout_s))[0].splitlines()[-30:], "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own process group: anything it started goes too
        proc.communicate()
        tail, status = ["timeout"], "timeout"
    records = []
    for spec in specs:
        out = Path(spec["progress_to"])
        record = json.loads(out.read_text()) if out.exists() else {}
        if record.get("status") not in (None, "partial"):
            records.append(record)
        else:  # killed or failed: the partial record's curve, with our spec and status
            ended = dict(spec=spec, status=status, output_tail=tail, wall_s=time.perf_counter() - t0)
            records.append({"train": [], "evals": [], **record, **ended})
    return records


def run_specs(specs: list[dict], runs_dir: Path, parallel: int, budget_s: float, on_wave=None, per_process=1):
    """Run specs within budget_s seconds: `per_process` consecutive specs one after another in one child
    process, `parallel` such processes at a time. Returns their records in order."""
    groups = [specs[i : i + per_process] for i in range(0, len(specs), per_process)]
    runs, start = [], time.perf_counter()
    for first in range(0, len(groups), parallel):
        wave = groups[first : first + parallel]
        later_waves = math.ceil((len(groups) - first) / parallel) - 1
        share = budget_s - (time.perf_counter() - start) - WAVE_RESERVE_S * later_waves
        deadline = time.time() + share - EVAL_RESERVE_S
        wave = [[dict(s, deadline=deadline) if s["steps"] == "auto" else s for s in g] for g in wave]
        with ThreadPoolExecutor(max_workers=len(wave)) as pool:
            futures = [pool.submit(launch, g, runs_dir / f"{g[0]['name']}.json", share) for g in wave]
            done = [r for f in futures for r in f.result()]
        for r in done:
            brief = {k: r.get(k) for k in ("status", "results", "wall_s", "train_s")}
            print(json.dumps(dict(name=r["spec"]["name"], **brief)), flush=True)
        runs += done
        if on_wave:
            on_wave(runs)
    return runs


def make_specs(args, protocol: str, init_from: str | None) -> list[dict]:
    """One spec per (seed, variant), a seed's variants consecutive (so --runs_per_process groups them)."""
    base = dict(protocol=protocol, task=TASKS[protocol], steps=args.steps, batch_size=args.batch_size)
    base.update(max_steps=args.max_steps, lr=args.lr, warmup=args.warmup, arch=args.arch)
    base.update(eval_samples=args.eval_samples, log_every=args.log_every, init_from=init_from)
    base["init_id"] = init_from and Path(init_from).name
    pairs = [(s, v) for s in args.seeds for v in args.variants]
    return [dict(base, variant=v, seed=s, name=f"{protocol}_{v}_seed{s}") for s, v in pairs]


def parse_args() -> argparse.Namespace:
    parser = common.parser_of(__doc__)
    parser.add_argument("--out_dir", required=True, help="parity.json and parity.md go here")
    runs = parser.add_argument_group("runs")
    runs.add_argument("--protocol", choices=("finetune", "scratch"), default="finetune")
    runs.add_argument("--variants", nargs="+", type=variant_arg, default=["bf16", "int8", "fp8"])
    runs.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    runs.add_argument("--arch", choices=list(ARCHS), default="small", help="model size (graded_run.ARCHS)")
    runs.add_argument("--batch_size", type=int, default=256)
    runs.add_argument("--eval_samples", type=int, default=10_000, help="held-out images of the final eval")
    runs.add_argument("--smoke", action="store_true", help="CPU test size: tiny model, 6 steps")
    schedule = parser.add_argument_group("schedule (the same for every run: pairs must train alike)")
    schedule.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    schedule.add_argument("--lr", type=float, default=3e-4)
    schedule.add_argument("--warmup", type=int, default=30, help="linear warm-up steps, then cosine decay")
    auto = "finetune: bf16 steps, or 'auto': what fits in --pretrain_share of the budget (<= --max_steps)"
    schedule.add_argument("--pretrain_steps", type=steps_arg, default=1500, help=auto)
    schedule.add_argument("--max_steps", type=int, default=3000, help="upper bound for --pretrain_steps auto")
    schedule.add_argument("--pretrain_lr", type=float, default=1e-3)
    device = parser.add_argument_group("sharing the device")
    device.add_argument("--parallel", type=int, default=1, help="child processes running at once")
    device.add_argument("--runs_per_process", type=int, default=1, help="consecutive runs sharing a process")
    device.add_argument("--time_budget_s", type=float, default=500, help="runs not finished by then: timeout")
    device.add_argument("--pretrain_share", type=float, default=0.4, help="budget share pretraining may use")
    device.add_argument("--warm", action="store_true", help="fill Triton's kernel cache first (a GPU run)")
    parser.add_argument("--merge", nargs="+", metavar="PARITY_JSON", help="re-summarize these files, no runs")
    parser.add_argument("--one_run", help=argparse.SUPPRESS)  # a child process: the specs file it runs
    args = parser.parse_args()
    if args.runs_per_process < 1 or args.parallel < 1:
        parser.error("--parallel and --runs_per_process must be >= 1")
    args.log_every = 5
    if args.smoke:
        args.arch, args.steps, args.batch_size, args.warmup, args.pretrain_steps = "tiny", 6, 16, 2, 6
        args.eval_samples, args.log_every = 64, 1
    return args


def merge(paths: list[str], out_dir: Path) -> None:
    loaded = [json.loads(Path(p).read_text()) for p in paths]
    for path, data in zip(paths, loaded, strict=True):
        if any("spec" not in r for r in data["runs"]):  # BENCHMARKS.md's ViT-B/16 runs
            sys.exit(f"{path}: runs of the train_clip harness; merge them with parity.py of commit aa227a1")
    write_outputs([r for d in loaded for r in d["runs"]], loaded[0]["env"], out_dir)


def run(args, out_dir: Path) -> None:
    import torch

    runs_dir, start, init_from, runs = Path(tempfile.mkdtemp(prefix="parity_")), time.perf_counter(), None, []
    env = dict(arch=args.arch, batch_size=args.batch_size, eval_samples=args.eval_samples, args=vars(args))
    env.update(common.versions("cuda" if torch.cuda.is_available() else "cpu", ("triton", "transformers")))
    # A few steps of each Triton variant beside the pretraining fill Triton's on-disk kernel cache, so that the
    # parallel runs after them do not all compile and autotune the same kernels at once.
    warm = [dict(s, steps=3, eval_samples=min(1000, args.eval_samples), name=f"warm_{s['variant']}", protocol="warm")
            for s in make_specs(args, args.protocol, None)[: len(args.variants)]
            if args.warm and s["variant"] in WARM_VARIANTS]  # fmt: skip
    first = []
    if args.protocol == "finetune":
        init_from = str(runs_dir / "pretrained")
        steps = args.pretrain_steps
        warmup = 2 * args.warmup if steps == "auto" else max(args.warmup, steps // 20)
        pre = dict(make_specs(args, "pretrain", None)[0], variant="bf16", seed=0, name="pretrain")
        first = [dict(pre, steps=steps, save_to=init_from, lr=args.pretrain_lr, warmup=warmup)]
    if first or warm:
        done = run_specs(first + warm, runs_dir, len(first + warm), args.pretrain_share * args.time_budget_s)
        runs += [r for r in done if r["spec"]["protocol"] != "warm"]
    if first:
        keys = ("results", "zero_shot_before_finetune", "train_s", "status")
        env["pretrain"] = {k: runs[0].get(k) for k in keys}
        if runs[0].get("status") != "ok":
            write_outputs(runs, env, out_dir)
            sys.exit(f"pretraining failed: {runs[0].get('output_tail')}")

    def on_wave(done: list[dict]) -> None:  # a call killed from outside still leaves the table so far
        write_outputs(runs + done, env, out_dir)

    specs, left = make_specs(args, args.protocol, init_from), args.time_budget_s - time.perf_counter() + start
    runs += run_specs(specs, runs_dir, args.parallel, left, on_wave, args.runs_per_process)
    write_outputs(runs, env, out_dir)


def main() -> None:
    args = parse_args()
    if args.one_run:  # a child process: its runs one after another, each record to the spec's progress_to
        for spec in json.loads(Path(args.one_run).read_text()):
            common.write_json(Path(spec["progress_to"]), train_graded(spec))
        return
    if args.merge:
        merge(args.merge, Path(args.out_dir))
    else:
        run(args, Path(args.out_dir))
    print((Path(args.out_dir) / "parity.md").read_text())


if __name__ == "__main__":
    main()
