"""Accuracy parity: SwitchBack variants against bf16 in paired runs (same init, same batches), 95% t intervals.

Three protocols:

    finetune    small CLIP models on `accuracy.graded_shapes`: pretrain once in bf16 on the PRETRAIN task (8
                colours x 6 shapes) and save a normal HF checkpoint (CLIPModel.save_pretrained + tokenizer), or
                take one with --init_from DIR; then fine-tune it on the shifted FINETUNE task (6 new colours, 4
                new shapes, new words) once per (variant, seed)
    scratch     the same models from a seeded random init on the ALL task (14 colours x 10 shapes, graded)
    train_clip  examples/train_clip.py itself per (variant, seed): --model_config (ViT-B/16) from scratch on
                the embedded synthetic set, its DataLoader workers, bf16 autocast on a GPU. That task leaves its
                loss plateau at a step that varies by hundreds between seeds and has 576 eval images, so it
                cannot resolve 0.5 pp (BENCHMARKS.md); it checks the training script end to end at full size

Graded-shapes batches are generated on the device from (seed, step), so runs of one seed see identical batches
and need no loader workers; the eval uses --eval_samples held-out images (default 10,000: one accuracy's
binomial SE is at most 0.5 pp): zero-shot top-1 over colour x shape classes and image->caption R@1 (the one full
caption among all of the task's; train_clip: its image_to_text_R@1). Every run is paired with the bf16 run of the
same seed and schedule; per variant the table gives the mean paired difference of zero-shot, R@1 and final loss
with its 95% Student t interval, and the verdict against +-0.5 pp. It also dates when each run's smoothed loss
crossed fixed fractions of its way down, to show whether runs split into early and late escapes.

Variants: bf16 (no SwitchBack), int8 (the library default: on Hopper/Ada fp8 output gradients), fp8,
int8-int8grad (the paper's all-int8), int8-rowweight (row-wise weight scales), int8-memeff (the memory switch:
memory_efficient=True), fp8-wgrad8 (fp8 with wgrad_precision="fp8": the weight gradient in fp8 too), and, graded
shapes only, sim-<q>: all-int8 SwitchBack simulated in torch (`accuracy.sim_switchback`) with output-gradient
quantizer q (row, block128, row-sr, row-outlier8, ...).

    # one H100: pretrain once, then 4 variants x 5 seeds fine-tuned, one process per seed (its 4 variants one
    # after another: small runs are host-bound, and each process pays its own CUDA context and Triton autotune;
    # 12-20 processes of one run each on 16 CPU cores did not finish a single SwitchBack run)
    PYTHONPATH=src python benchmarks/parity.py --protocol finetune --arch small --batch_size 512 \
        --eval_samples 5000 --variants bf16 int8 fp8 int8-int8grad --seeds 0 1 2 3 4 --parallel 5 \
        --runs_per_process 4 --pretrain_steps auto --steps 150 --warmup 15 --lr 3e-4 --warm --out_dir $OUT/ft
    # ViT-B/16 through train_clip.py, two runs sharing the GPU (~420 s on an H100)
    PYTHONPATH=src python benchmarks/parity.py --protocol train_clip --steps 1000 --batch_size 256 --lr 5e-4 \
        --warmup 60 --eval_samples 576 --eval_every 100 --seeds 3 --variants bf16 int8 --parallel 2 \
        --num_workers 7 --time_budget_s 570 --out_dir $OUT/s3
    # re-summarize (and plot) saved results on any machine
    python benchmarks/parity.py --merge ft/parity.json --out_dir docs/figures/parity_finetune
    # CPU smoke tests
    PYTHONPATH=src python benchmarks/parity.py --protocol finetune --smoke --out_dir /tmp/pg
    PYTHONPATH=src python benchmarks/parity.py --protocol train_clip --smoke --variants bf16 int8 --out_dir /tmp/pc
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # `accuracy` and `common`, however this file is loaded
import common  # noqa: E402
from accuracy.graded_run import ARCHS, SWITCHBACK_FIELDS, train_graded, write_atomic  # noqa: E402
from accuracy.summary import write_outputs  # noqa: E402
from accuracy.train_clip_run import (  # noqa: E402
    VIT_B16,
    from_train_clip_harness,
    read_train_log,
    run_dir_of,
    tiny_clip_config,
    train_clip_run,
)

PROTOCOL_TASK = {"pretrain": "pretrain", "finetune": "finetune", "scratch": "all", "train_clip": "default"}
WAVE_RESERVE_S = 25
EVAL_RESERVE_S = 20.0  # steps="auto": time kept for the final eval (and saving) after training
TRAIN_CLIP_EVAL_SET = 576  # distinct eval images of the embedded synthetic set (train_clip refuses more)


def check_variant(variant: str) -> str:
    """argparse type of --variants: bf16, a SWITCHBACK_FIELDS name, or sim-<gradient quantizer>."""
    if variant == "bf16" or variant in SWITCHBACK_FIELDS:
        return variant
    if variant.startswith("sim-"):
        from accuracy.grad_quant_sim import parse_grad_quantizer

        parse_grad_quantizer(variant[len("sim-") :])
        return variant
    raise argparse.ArgumentTypeError(f"unknown variant {variant!r}")


def train_one(spec: dict) -> dict:
    """One run in this (child) process: its record."""
    return train_clip_run(spec) if spec.get("model_config") else train_graded(spec)


# ------------------------------------------------------------------------------------------------------------
# Many runs (subprocesses, several at a time)
# ------------------------------------------------------------------------------------------------------------
def launch(specs: list[dict], path: Path, timeout_s: float) -> list[dict]:
    """Run `specs` one after another in one child process (one CUDA context and one Triton autotune for all
    of them); their records, a failure record for each that did not finish."""
    specs = [dict(s, progress_to=str(path.with_name(f"{s['name']}.out.json"))) for s in specs]
    for s in specs:
        Path(s["progress_to"]).unlink(missing_ok=True)
    path.write_text(json.dumps(specs))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one_run",
        str(path),
        "--out_dir",
        str(path.parent),
    ]
    t0 = time.perf_counter()
    # its own process group, killed whole on timeout: train_clip runs and their DataLoader workers go with it
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        tail, status = proc.communicate(timeout=max(5.0, timeout_s))[0].splitlines()[-30:], "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        tail, status = ["timeout"], "timeout"
    records = []
    for spec in specs:
        out = Path(spec["progress_to"])
        record = json.loads(out.read_text()) if out.exists() else {}
        if record and record.get("status") != "partial":
            records.append(record)
            continue
        # a killed or failed run: its curve so far (written every 25 steps, or train_clip's log), no final eval
        # (the partial record carries its own spec and status: ours replace them, not collide with them)
        train, evals = (
            read_train_log(run_dir_of(spec) / "train_log.jsonl") if "runs_dir" in spec else ([], [])
        )
        empty = dict(train=train, evals=evals, grad_stats=[])
        ended = dict(spec=spec, status=status, output_tail=tail, wall_s=time.perf_counter() - t0)
        records.append({**empty, **record, **ended})
    return records


def run_specs(
    specs: list[dict], runs_dir: Path, parallel: int, budget_s: float, on_wave=None, per_process: int = 1
) -> list[dict]:
    """Run specs within budget_s seconds: `per_process` consecutive specs one after another in one child
    process, `parallel` such processes at a time. Returns their records in order."""
    groups = [specs[i : i + per_process] for i in range(0, len(specs), per_process)]
    runs, start = [], time.perf_counter()
    for first in range(0, len(groups), parallel):
        wave = groups[first : first + parallel]
        left = budget_s - (time.perf_counter() - start)
        # the wave may use all but WAVE_RESERVE_S per later wave: a slow first wave still finishes (whole
        # pairs), later ones are cut instead
        share = left - WAVE_RESERVE_S * (math.ceil((len(groups) - first) / parallel) - 1)
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


def environment(args) -> dict:
    arch = Path(args.model_config).name if args.protocol == "train_clip" else args.arch
    env = dict(arch=arch, batch_size=args.batch_size, eval_samples=args.eval_samples, args=vars(args).copy())
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return dict(env, **common.versions(device, ("triton", "transformers")))


def steps_arg(value: str):
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive step count or 'auto', got {value!r}")
    return int(value)


def make_specs(args, protocol: str, init_from: str | None) -> list[dict]:
    base = dict(protocol=protocol, task=PROTOCOL_TASK[protocol], steps=args.steps, batch_size=args.batch_size)
    base.update(
        max_steps=args.max_steps,
        lr=args.lr,
        warmup=args.warmup,
        arch=args.arch,
        eval_samples=args.eval_samples,
    )
    base.update(log_every=args.log_every, init_from=init_from, init_id=init_from and Path(init_from).name)
    base.update(
        stats_every=args.stats_every, stat_quantizers=args.stat_quantizers, eval_every=args.eval_every
    )
    specs = [
        dict(base, variant=v, seed=s, name=f"{protocol}_{v}_seed{s}")
        for s in args.seeds
        for v in args.variants
    ]
    if protocol == "train_clip":
        arch = Path(args.model_config).name
        extra = dict(model_config=str(args.model_config), arch=arch, num_workers=args.num_workers)
        # train_clip hands each DataLoader worker whole batches: the batches do not depend on the worker count
        extra["data_order"] = "worker-blocks"
        specs = [dict(s, **extra, runs_dir=str(args.runs_dir)) for s in specs]
    return specs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out_dir", required=True, help="parity.json / .md / _loss.png go here")
    parser.add_argument("--protocol", choices=("finetune", "scratch", "train_clip"), default="finetune")
    parser.add_argument(
        "--init_from", help="finetune: start from this HF CLIP checkpoint instead of pretraining"
    )
    parser.add_argument("--variants", nargs="+", type=check_variant, default=["bf16", "int8", "fp8"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--arch", choices=list(ARCHS), default="small", help="graded shapes: the model size")
    parser.add_argument("--model_config", default=str(VIT_B16), help="train_clip: the CLIP config JSON")
    parser.add_argument("--num_workers", type=int, default=10, help="train_clip: DataLoader workers")
    parser.add_argument(
        "--steps",
        type=int,
        default=300,
        help="optimizer steps per run (one count for all: pairs must train alike)",
    )
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument(
        "--pretrain_steps",
        type=steps_arg,
        default=1500,
        help="or 'auto': as many as fit in --pretrain_share of the budget, decided from the speed of the first "
        "2 x --warmup steps",
    )
    parser.add_argument("--max_steps", type=int, default=3000, help="upper bound for --pretrain_steps auto")
    parser.add_argument("--pretrain_lr", type=float, default=1e-3)
    parser.add_argument(
        "--eval_samples",
        type=int,
        help="held-out images (default: 10,000; train_clip: its set's 576, the most)",
    )
    parser.add_argument("--eval_every", type=int, default=0, help="extra evals every N steps (0: final only)")
    parser.add_argument("--log_every", type=int, default=5)
    parser.add_argument(
        "--stats_every", type=int, default=50, help="sim-* variants: gradient statistics every N"
    )
    parser.add_argument(
        "--stat_quantizers", nargs="+", default=["row", "block32", "block128", "row-sr", "row-outlier8"]
    )
    parser.add_argument("--parallel", type=int, default=1, help="processes sharing the device at once")
    parser.add_argument(
        "--runs_per_process",
        type=int,
        default=1,
        help="consecutive runs (a seed's variants, in --variants order) one after another in one process: one "
        "CUDA context, one Triton compile and autotune, instead of one per run",
    )
    parser.add_argument("--time_budget_s", type=float, default=500)
    parser.add_argument("--warm", action="store_true", help="fill Triton's kernel cache first (a GPU run)")
    parser.add_argument(
        "--pretrain_share",
        type=float,
        default=0.4,
        help="at most this share of the time budget for pretraining",
    )
    parser.add_argument("--runs_dir", help="run files and the pretrained checkpoint (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="CPU test size: tiny model, few steps")
    parser.add_argument("--merge", nargs="+", help="re-summarize these parity.json files, no runs")
    parser.add_argument("--one_run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    if args.runs_per_process < 1 or args.parallel < 1:
        parser.error("--parallel and --runs_per_process must be >= 1")

    if args.protocol == "train_clip" and any(v.startswith("sim-") for v in args.variants):
        parser.error("sim-* variants simulate linears in the graded-shapes protocols only")
    if args.eval_samples is None:
        args.eval_samples = TRAIN_CLIP_EVAL_SET if args.protocol == "train_clip" else 10_000
    if args.protocol == "train_clip" and args.eval_samples > TRAIN_CLIP_EVAL_SET:
        parser.error(f"--eval_samples: train_clip's synthetic eval set has {TRAIN_CLIP_EVAL_SET} images")
    if args.one_run:  # child process: its runs one after another, each record to the spec's progress_to
        for spec in json.loads(Path(args.one_run).read_text()):
            write_atomic(Path(spec["progress_to"]), train_one(spec))
        return
    if args.merge:
        loaded = [json.loads(Path(p).read_text()) for p in args.merge]
        runs = [r if "spec" in r else from_train_clip_harness(r, d["env"]) for d in loaded for r in d["runs"]]
        first = runs[0]["spec"]  # the former harness's env has no arch / eval set size
        env = {"arch": first.get("arch"), "eval_samples": first.get("eval_samples"), **loaded[0]["env"]}
        write_outputs(runs, env, out_dir)
        print((out_dir / "parity.md").read_text())
        return
    args.runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="parity_")
    runs_dir = Path(args.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.arch, args.steps, args.batch_size, args.warmup, args.pretrain_steps = "tiny", 6, 16, 2, 6
        args.eval_samples, args.log_every, args.stats_every, args.num_workers = 64, 1, 2, 0
        if args.protocol == "train_clip":
            args.model_config = str(tiny_clip_config(Path(args.model_config), runs_dir))
    env = environment(args)
    start = time.perf_counter()
    init_from, runs = args.init_from, []
    # A few steps of each Triton variant beside the pretraining (or first): they fill Triton's on-disk kernel
    # cache, so the parallel runs after them do not all compile (and autotune) the same kernels at once.
    warm = [
        dict(
            spec,
            steps=3,
            eval_samples=min(1000, args.eval_samples),
            name=f"warm_{spec['variant']}",
            init_from=None,
            protocol="warm",
        )
        for spec in make_specs(args, args.protocol, None)[: len(args.variants)]
        if args.warm and spec["variant"] in ("int8", "fp8", "int8-int8grad")
    ]
    first = []
    if args.protocol == "finetune" and not init_from:
        init_from = str(runs_dir / "pretrained")
        pre = make_specs(args, "finetune", None)[0]
        pre.update(protocol="pretrain", task="pretrain", variant="bf16", seed=0, name="pretrain")
        auto = args.pretrain_steps == "auto"
        warmup = 2 * args.warmup if auto else max(args.warmup, args.pretrain_steps // 20)
        pre.update(save_to=init_from, steps=args.pretrain_steps, lr=args.pretrain_lr, warmup=warmup)
        first.append(pre)
    if first or warm:
        done = run_specs(first + warm, runs_dir, len(first + warm), args.pretrain_share * args.time_budget_s)
        runs += [r for r in done if r["spec"]["protocol"] != "warm"]
    if first:
        env["pretrain"] = {
            k: runs[0].get(k) for k in ("results", "zero_shot_before_finetune", "train_s", "status")
        }
        if runs[0].get("status") != "ok":
            write_outputs(runs, env, out_dir)
            sys.exit(f"pretraining failed: {runs[0].get('output_tail')}")
    specs = make_specs(args, args.protocol, init_from)
    left = args.time_budget_s - (time.perf_counter() - start)
    runs += run_specs(
        specs,
        runs_dir,
        args.parallel,
        left,
        on_wave=lambda done: write_outputs(runs + done, env, out_dir),
        per_process=args.runs_per_process,
    )
    write_outputs(runs, env, out_dir)
    print((out_dir / "parity.md").read_text())


if __name__ == "__main__":
    main()
