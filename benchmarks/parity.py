"""Accuracy parity: bf16 vs SwitchBack int8 vs fp8 on the same CLIP training run.

Runs examples/train_clip.py once per (variant, seed) on one GPU (one after another, or --parallel N at once): ViT-B/16 from
examples/configs/clip-vit-b-16.json (random init, 224 px), the embedded synthetic shapes set, bf16 autocast,
the same seed (same init, same data order) for every variant, so the runs differ only in the linears. Then
reads each run's train_log.jsonl and all_results.json and writes, to --out_dir:

    parity.json       environment, arguments, and every run's logged losses, evals and final results
    parity.md         the table: final loss (and its paired difference to bf16), zero-shot, retrieval, speed
    parity_loss.png   loss curves (and eval curves) of all runs (needs matplotlib; else re-plot with --merge)

    # one H100, ~8-9 minutes for the three default runs (bf16, int8, fp8; add int8-int8grad with --variants):
    PYTHONPATH=src python benchmarks/parity.py --out_dir $OUT --time_budget_s 530
    # a second seed (noise floor: bf16 vs bf16 across seeds), then one table and plot from both, on any machine:
    PYTHONPATH=src python benchmarks/parity.py --out_dir $OUT --seeds 1 --variants bf16 int8
    python benchmarks/parity.py --merge seed0/parity.json seed1/parity.json --out_dir docs/figures
    # CPU smoke test (tiny model, a few steps):
    PYTHONPATH=src python benchmarks/parity.py --smoke --out_dir /tmp/parity --variants bf16 int8

Reading the result: the synthetic zero-shot task (32 colour x shape classes) saturates early, so the final
loss (mean of the last 20% of logged steps; the per-step difference to bf16 at the same seed removes batch
noise) and retrieval recall over 576 distinct captions (colour, shape, size and position must all match) are
the metrics that separate the variants. The eval set has at most 576 images, so one eval metric has a
binomial standard error of up to ~2 pp: a 0.5 pp gap in zero-shot cannot be resolved by one run.
Worse, the ViT-B/16 run makes one sharp loss drop between steps ~250 and ~400, and when it happens varies
from run to run, for bf16 as for int8: on the H100 the same int8 run (seed 2) ended at 63% zero-shot with one
data order and 97% with another, and a 1000-step bf16 run (seed 4) reached loss 2.5 only at step ~620 and ended
at 85% against int8's 100% (BENCHMARKS.md, Accuracy). Judge a variant by the table "Pooled over
seeds" (each run paired with the bf16 run of the same seed, schedule and data order), not by one seed; the
1000-step protocol (one device call per seed, ~420 s on an H100):

    PYTHONPATH=src python benchmarks/parity.py --out_dir $OUT/sN --steps 1000 --seeds N --variants bf16 int8 \
        --parallel 2 --num_workers 7 --time_budget_s 570
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
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402
from common import mean_se, t95  # noqa: E402

TRAIN_SCRIPT = ROOT / "examples" / "train_clip.py"
MODEL_CONFIG = ROOT / "examples" / "configs" / "clip-vit-b-16.json"
# --min_tokens 0: a parity run measures the 8-bit path; with the default floor the measured crossover table
# (kernels/crossover) would keep most layers 16-bit on Hopper and compare bf16 with itself.
_SB = ["--switchback", "on", "--min_tokens", "0"]
VARIANT_FLAGS = {
    "bf16": ["--switchback", "off"],
    "int8": [*_SB, "--precision", "int8"],
    "fp8": [*_SB, "--precision", "fp8"],
    "int8-int8grad": [*_SB, "--precision", "int8", "--grad_precision", "int8"],
    "int8-rowweight": [*_SB, "--precision", "int8", "--weight_scaling", "row"],
    # the memory switch (8-bit saved inputs, fused MLPs with fc1's output recomputed)
    "int8-memeff": [*_SB, "--precision", "int8", "--memory_efficient"],
}
EVAL_METRICS = ("zero_shot_top1", "zero_shot_top5", "image_to_text_R@1", "text_to_image_R@1")
LAST_FRACTION = 0.2  # "final loss" = mean over the last 20% of logged steps
# The ViT-B/16 task plateaus near loss 3.0-3.1, then drops to ~2.0: the first logged step at which the smoothed
# loss reaches DROP_LOSS dates that drop, the event whose timing decides most of a 500-step run's final metrics.
DROP_LOSS = 2.5
PARITY_BOUND_PP = -0.5  # the parity goal: int8 zero-shot no more than 0.5 pp below bf16
SETUP_RESERVE_S = 15  # summary + plot after the last run


def train_command(
    args: argparse.Namespace, variant: str, seed: int, run_dir: Path, config: Path
) -> list[str]:
    """The train_clip.py command line of one run."""
    cmd = [sys.executable, str(TRAIN_SCRIPT), "--model_config", str(config), *VARIANT_FLAGS[variant]]
    # the harness writes the run's own log into run_dir first, so the dir is never empty
    cmd += ["--seed", str(seed), "--output_dir", str(run_dir), "--overwrite_output_dir"]
    cmd += ["--report_to", "none"]
    cmd += ["--batch_size", str(args.batch_size), "--max_train_steps", str(args.steps)]
    cmd += ["--synthetic_train_samples", str(args.steps * args.batch_size)]  # one epoch: no loader restart
    cmd += ["--lr", str(args.lr), "--warmup_steps", str(args.warmup_steps)]
    cmd += ["--num_workers", str(args.num_workers), "--max_eval_samples", str(args.eval_samples)]
    cmd += ["--logging_steps", str(args.logging_steps), "--eval_steps", str(args.eval_steps)]
    cmd += ["--mixed_precision", args.mixed_precision]
    if args.torch_compile:
        cmd.append("--torch_compile")
    return cmd + args.extra


def run_training(cmd: list[str], timeout_s: float, log_file: Path) -> dict:
    """Run one training process (own process group, killed whole on timeout); its status and wall time."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    with open(log_file, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=max(1.0, timeout_s))
            status = "ok" if returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            # the process group: the DataLoader workers go with the trainer
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            returncode, status = proc.returncode, "timeout"
    tail = log_file.read_text(errors="replace").splitlines()[-40:] if status != "ok" else []
    return dict(status=status, returncode=returncode, wall_s=time.perf_counter() - t0, output_tail=tail)


def one_run(args, seed: int, variant: str, runs_dir: Path, config: Path, budget_s: float) -> dict:
    """Train one (variant, seed) within budget_s seconds; its record for parity.json."""
    run_dir = runs_dir / f"{variant}_seed{seed}"
    run = dict(variant=variant, seed=seed, train=[], evals=[], results=None, data_layout=DATA_LAYOUT)
    if budget_s < 30:
        return {**run, "status": "skipped", "wall_s": 0.0}
    cmd = train_command(args, variant, seed, run_dir, config)
    run["command"] = " ".join(cmd)
    run_dir.mkdir(parents=True, exist_ok=True)
    run.update(run_training(cmd, budget_s, run_dir / "stdout.txt"))
    run["train"], run["evals"] = read_train_log(run_dir / "train_log.jsonl")
    results = run_dir / "all_results.json"
    run["results"] = json.loads(results.read_text()) if results.exists() else None
    return run


def read_train_log(path: Path) -> tuple[list[dict], list[dict]]:
    """(training lines, eval lines) of a train_log.jsonl; eval lines are the ones without a loss."""
    train, evals = [], []
    if not path.exists():
        return train, evals
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            (train if "loss" in record else evals).append(record)
    return train, evals


def tail_window(train: list[dict]) -> list[dict]:
    """The last LAST_FRACTION of logged training steps (at least one)."""
    return train[-max(1, math.ceil(len(train) * LAST_FRACTION)) :]


def drop_step(train: list[dict], level: float) -> int | None:
    """First logged step whose smoothed loss (EMA 0.8, as plotted) is at or below `level`; None if never."""
    if not train:
        return None
    for entry, smoothed in zip(train, ema_of([x["loss"] for x in train]), strict=True):
        if smoothed <= level:
            return entry["step"]
    return None


# Since 2026-11-23 (train_clip's CaptionStream hands each dataloader worker whole batches) the batches no longer
# depend on --num_workers; runs from before it are marked by the absence of this field in their record.
DATA_LAYOUT = "worker-blocks"


def command_flag(run: dict, flag: str) -> str | None:
    """The value of `flag` in a run's train_clip.py command (its last one, as argparse reads it), or None."""
    command = run.get("command") or []
    words = command.split() if isinstance(command, str) else list(command)
    value = None
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith(flag + "="):
            value = word[len(flag) + 1 :]
    return value


def num_workers(run: dict) -> int | None:
    workers = command_flag(run, "--num_workers")
    return None if workers is None else int(workers)


def data_order(run: dict) -> tuple:
    """What fixes a run's batches and schedule; runs are paired with bf16 only when these are all equal.

    The seed, the model, the step count, batch size, learning rate, warm-up and autocast (a 500-step run is not
    a 1000-step run cut short: the cosine schedule differs), and the data layout: before DATA_LAYOUT each
    dataloader worker took every W-th sample, so the batches depended on --num_workers W as well.
    """
    config = command_flag(run, "--model_config")
    schedule = tuple(
        command_flag(run, f)
        for f in ("--max_train_steps", "--batch_size", "--lr", "--warmup_steps", "--mixed_precision")
    )
    layout = run.get("data_layout")
    order = (layout,) if layout is not None else ("strided", num_workers(run))
    return (run["seed"], config and Path(config).name, *schedule, *order)


def bf16_partners(runs: list[dict]) -> dict:
    """The finished bf16 run of each data order (a killed or skipped one pairs with nothing, so a re-run may
    be merged beside it)."""
    partners = {}
    for r in runs:
        if r["variant"] == "bf16" and r.get("status") == "ok":
            key = data_order(r)
            if key in partners:
                raise ValueError(
                    f"two bf16 runs with the same seed, schedule and data order {key}: a run could be paired "
                    "with either; merge only one of them"
                )
            partners[key] = r
    return partners


def summarize(runs: list[dict], drop_loss: float = DROP_LOSS) -> list[dict]:
    """One row per run: final loss, paired differences to bf16 of the same data order, eval metrics, speed.

    Differences are filled in only when both runs finished (status "ok"): a killed run's last eval is mid-run.
    """
    bf16 = bf16_partners(runs)
    rows = []
    for r in runs:
        window = tail_window(r["train"]) if r["train"] else []
        loss, loss_se = mean_se([x["loss"] for x in window])
        key = data_order(r)
        row = dict(variant=r["variant"], seed=r["seed"], status=r["status"], wall_s=r.get("wall_s"))
        row["workers"] = num_workers(r)
        row.update(steps=r["train"][-1]["step"] if r["train"] else 0, final_loss=loss, final_loss_se=loss_se)
        row["drop_step"] = drop_step(r["train"], drop_loss)
        base = bf16.get(key)
        if base is r or base is None or r["status"] != "ok" or base["status"] != "ok":
            base = None  # nothing to pair with
        if base is not None and window:
            base_loss = {x["step"]: x["loss"] for x in base["train"]}
            diffs = [x["loss"] - base_loss[x["step"]] for x in window if x["step"] in base_loss]
            row["dloss_vs_bf16"], row["dloss_vs_bf16_se"] = mean_se(diffs)
        results = r.get("results") or {}
        last_eval = r["evals"][-1] if r["evals"] else {}
        for key in EVAL_METRICS:
            row[key] = results.get(key, last_eval.get(key))  # final eval, else the last one logged
        row["eval_samples"] = results.get("eval_samples")
        row["samples_per_s"] = results.get("train_samples_per_second_steady") or results.get(
            "train_samples_per_second"
        )
        row["peak_mem_gib"] = results.get("peak_memory_allocated_gib")
        if base is not None:
            base_results = base.get("results") or {}
            for key in ("zero_shot_top1", "image_to_text_R@1", "text_to_image_R@1"):
                if row[key] is not None and base_results.get(key) is not None:
                    row[f"d_{key}_pp"] = 100 * (row[key] - base_results[key])
            base_drop = drop_step(base["train"], drop_loss)
            if row["drop_step"] is not None and base_drop is not None:
                row["d_drop_step"] = row["drop_step"] - base_drop
        rows.append(row)
    return rows


def pooled(rows: list[dict]) -> list[dict]:
    """Per variant, over the seeds that have a bf16 run: mean zero-shot and loss differences to bf16."""
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows if r["variant"] != "bf16"):
        mine = [r for r in rows if r["variant"] == variant and r.get("d_zero_shot_top1_pp") is not None]
        if not mine:
            continue
        deltas = [r["d_zero_shot_top1_pp"] for r in mine]
        mean, se = mean_se(deltas)
        dloss, _ = mean_se([r["dloss_vs_bf16"] for r in mine if r.get("dloss_vs_bf16") is not None])
        ddrop, _ = mean_se([r["d_drop_step"] for r in mine if r.get("d_drop_step") is not None])
        # paired runs that never reached the level: left out of the mean, so counted apart
        never = sum(1 for r in mine if r.get("drop_step") is None)
        # how many pairs meet the bound: one outlier pair moves this count by one, the mean by its whole size
        # (one-sided: a late bf16 run counts as a pass for the other variant)
        within = sum(1 for d in deltas if d >= PARITY_BOUND_PP)
        out.append(
            dict(variant=variant, seeds=len(deltas), d_zero_shot_pp=mean, d_zero_shot_se=se,
                 d_zero_shot_min=min(deltas), d_zero_shot_max=max(deltas), dloss_vs_bf16=dloss,
                 d_drop_step=ddrop, drop_never=never, within_bound=within)
        )  # fmt: skip
    return out


MIN_SEEDS_FOR_VERDICT = 3


def parity_verdict(pool: dict, bound_pp: float = PARITY_BOUND_PP) -> str:
    """The int8 target (zero-shot no more than 0.5 pp below bf16) read off a 95% t interval of the mean."""
    n, mean, se = pool["seeds"], pool["d_zero_shot_pp"], pool["d_zero_shot_se"]
    if n < MIN_SEEDS_FOR_VERDICT or se is None:
        return f"not resolved ({n} paired run(s); needs >= {MIN_SEEDS_FOR_VERDICT})"
    low, high = mean - t95(n - 1) * se, mean + t95(n - 1) * se
    interval = f"95% interval {low:+.2f} to {high:+.2f} pp"
    if low >= bound_pp:
        return f"met ({interval})"
    if high < bound_pp:
        return f"missed ({interval})"
    return f"not resolved ({interval} spans {bound_pp:+.1f} pp: run more seeds)"


def _fmt(value, spec: str = ".4f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def markdown(rows: list[dict], env: dict, drop_loss: float = DROP_LOSS) -> str:
    """The parity table, its environment and how to read it."""
    lines = [
        f"Parity run: {env.get('device', 'cpu')}, torch {env.get('torch')}, {env.get('model')}, "
        f"batch {env.get('batch_size')}, {env.get('steps')} steps, lr {env.get('lr')}.",
        "",
        "| variant | seed | workers | status | steps | final loss (last 20%) | Δ loss vs bf16 (paired) "
        f"| loss ≤ {drop_loss} at step (Δ) | zero-shot top-1 "
        "| Δ pp | i→t R@1 | t→i R@1 | Δ t→i pp | samples/s | peak GiB | wall s |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        loss = _fmt(r["final_loss"]) + (f" ± {r['final_loss_se']:.4f}" if r["final_loss_se"] else "")
        dloss = "-"
        if r.get("dloss_vs_bf16") is not None:
            se = r.get("dloss_vs_bf16_se")
            dloss = f"{r['dloss_vs_bf16']:+.4f}" + (f" ± {se:.4f}" if se else "")
        workers = "-" if r.get("workers") is None else r["workers"]
        drop = "never" if r.get("drop_step") is None else str(r["drop_step"])
        if r.get("d_drop_step") is not None:
            drop += f" ({r['d_drop_step']:+d})"
        lines.append(
            f"| {r['variant']} | {r['seed']} | {workers} | {r['status']} | {r['steps']} | {loss} | {dloss} | {drop} "
            f"| {_fmt(r['zero_shot_top1'], '.1%')} | {_fmt(r.get('d_zero_shot_top1_pp'), '+.2f')} "
            f"| {_fmt(r['image_to_text_R@1'], '.1%')} | {_fmt(r['text_to_image_R@1'], '.1%')} "
            f"| {_fmt(r.get('d_text_to_image_R@1_pp'), '+.2f')} | {_fmt(r['samples_per_s'], '.0f')} "
            f"| {_fmt(r['peak_mem_gib'], '.1f')} | {_fmt(r['wall_s'], '.0f')} |"
        )
    if env.get("args", {}).get("parallel", 1) > 1:
        lines += [
            "",
            f"{env['args']['parallel']} runs shared the GPU at a time: samples/s is not a speed figure.",
        ]
    n = max((r["eval_samples"] or 0 for r in rows), default=0)
    if n:
        lines += [
            "",
            f"Eval set: {n} images; one accuracy's binomial standard error is at most "
            f"{50 / math.sqrt(n):.1f} pp (p = 0.5), {100 * math.sqrt(0.9 * 0.1 / n):.1f} pp at p = 0.9. "
            "± on losses: standard error over the logged steps of the window (correlated steps: indicative).",
        ]
    for r in rows:
        if r["variant"] == "int8" and r.get("d_zero_shot_top1_pp") is not None:
            # "within 0.5 pp" is a bound on the loss of accuracy: int8 above bf16 meets it
            met = "met" if r["d_zero_shot_top1_pp"] >= PARITY_BOUND_PP else "missed"
            lines.append(
                f"Target int8 zero-shot within 0.5 pp of bf16 (seed {r['seed']} alone): {met} "
                f"({r['d_zero_shot_top1_pp']:+.2f} pp)."
            )
    pools = pooled(rows)
    if pools:
        lines += [
            "",
            "Pooled over seeds (each finished run minus the finished bf16 run of the same seed, schedule and data order; "
            "SE = standard error over those pairs):",
            "",
            f"| variant | seeds | mean Δ zero-shot pp ± SE | min / max Δ pp | pairs ≥ {PARITY_BOUND_PP} pp "
            f"| mean Δ loss | mean Δ step to {drop_loss} |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for p in pools:
            se = f" ± {p['d_zero_shot_se']:.2f}" if p["d_zero_shot_se"] is not None else ""
            never = f" ({p['drop_never']} never)" if p["drop_never"] else ""
            lines.append(
                f"| {p['variant']} | {p['seeds']} | {p['d_zero_shot_pp']:+.2f}{se} "
                f"| {p['d_zero_shot_min']:+.1f} / {p['d_zero_shot_max']:+.1f} | {p['within_bound']} of {p['seeds']} "
                f"| {_fmt(p['dloss_vs_bf16'], '+.4f')} "
                f"| {_fmt(p['d_drop_step'], '+.0f')}{never} |"
            )
        for p in pools:
            if p["variant"] == "int8":
                lines += ["", f"Target int8 zero-shot within 0.5 pp of bf16, pooled: {parity_verdict(p)}."]
    return "\n".join(lines) + "\n"


def ema_of(values: list[float], decay: float = 0.8) -> list[float]:
    out, ema = [], values[0]
    for v in values:
        ema = decay * ema + (1 - decay) * v
        out.append(ema)
    return out


def plot(runs: list[dict], path: Path) -> bool:
    """Loss curves (raw and smoothed) and eval curves; False when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(13, 4.8))
    FigureCanvasAgg(fig)
    ax_loss, ax_diff, ax_eval = fig.subplots(1, 3)
    bf16 = bf16_partners(runs)
    colors = {"bf16": "tab:blue", "int8": "tab:orange", "fp8": "tab:green", "int8-int8grad": "tab:red"}
    styles = ["-", "--", ":", "-."]
    for r in runs:
        if not r["train"]:
            continue
        label = f"{r['variant']} seed {r['seed']}"
        # e.g. cut by the time budget: its curves stop early, it has no final eval
        if r.get("status") != "ok":
            label += f" ({r.get('status')}, last logged step {r['train'][-1]['step']})"
        color, style = colors.get(r["variant"], "gray"), styles[r["seed"] % len(styles)]
        steps = [x["step"] for x in r["train"]]
        losses = [x["loss"] for x in r["train"]]
        ax_loss.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        ax_loss.plot(steps, ema_of(losses), color=color, linestyle=style, label=label)
        base = bf16.get(data_order(r))
        if base is not None and base is not r:
            base_loss = {x["step"]: x["loss"] for x in base["train"]}
            paired = [
                (x["step"], x["loss"] - base_loss[x["step"]]) for x in r["train"] if x["step"] in base_loss
            ]
            if paired:
                xs, ys = zip(*paired, strict=True)
                ax_diff.plot(xs, ema_of(list(ys)), color=color, linestyle=style, marker=".", label=label)
        for key, marker in (("zero_shot_top1", "o"), ("text_to_image_R@1", "s")):
            points = [(e["step"], e[key]) for e in r["evals"] if e.get(key) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax_eval.plot(xs, ys, color=color, linestyle=style, marker=marker, markersize=3)
    ax_loss.set(title="contrastive loss (EMA 0.8; raw faint)", xlabel="step", ylabel="loss")
    ax_diff.axhline(0.0, color="tab:blue", linewidth=0.8)
    ax_diff.set(title="loss minus bf16's, same data order and step (EMA)", xlabel="step")
    ax_eval.set(title="eval: zero-shot top-1 (o), text→image R@1 (s)", xlabel="step", ylim=(0, 1.02))
    for ax in (ax_loss, ax_diff, ax_eval):
        ax.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    if ax_diff.lines[1:]:
        ax_diff.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_outputs(runs: list[dict], env: dict, out_dir: Path, drop_loss: float = DROP_LOSS) -> list[dict]:
    """parity.json, parity.md and parity_loss.png in out_dir; returns the summary rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize(runs, drop_loss)
    (out_dir / "parity.json").write_text(
        json.dumps(dict(env=env, summary=rows, pooled=pooled(rows), runs=runs), indent=1)
    )
    text = markdown(rows, env, drop_loss)
    if not plot(runs, out_dir / "parity_loss.png"):
        text += "\n(no plot: matplotlib is not installed here; re-plot with --merge parity.json)\n"
    (out_dir / "parity.md").write_text(text)
    return rows


def tiny_config(directory: Path) -> Path:
    """The ViT-B/16 config shrunk to CPU-test size (smoke mode)."""
    config = json.loads(MODEL_CONFIG.read_text())
    tower = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    config["text_config"].update(tower, vocab_size=64, projection_dim=32)
    config["vision_config"].update(tower, image_size=32, patch_size=8, projection_dim=32)
    config["projection_dim"] = 32
    path = directory / "tiny_clip.json"
    path.write_text(json.dumps(config))
    return path


def environment(args: argparse.Namespace, config: Path) -> dict:
    import torch

    env = dict(
        model=config.name, args=vars(args).copy(), batch_size=args.batch_size, steps=args.steps, lr=args.lr
    )
    return dict(env, **common.versions("cuda" if torch.cuda.is_available() else "cpu", ()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out_dir", required=True, help="parity.json / .md / _loss.png go here")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANT_FLAGS), default=["bf16", "int8", "fp8"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="one run per variant and seed")
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps per run")
    parser.add_argument("--batch_size", type=int, default=256, help="per step (one GPU)")
    parser.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (cosine to 0)")
    parser.add_argument("--warmup_steps", type=int, default=60, help="linear warmup")
    parser.add_argument("--num_workers", type=int, default=10, help="DataLoader workers generating images")
    parser.add_argument("--eval_samples", type=int, default=576, help="distinct eval captions (max 576)")
    parser.add_argument("--eval_steps", type=int, default=100, help="eval every N steps (and at the end)")
    parser.add_argument("--logging_steps", type=int, default=5, help="loss logged every N steps")
    parser.add_argument("--mixed_precision", choices=("bf16", "no"), default="bf16", help="autocast dtype")
    parser.add_argument("--torch_compile", action="store_true", help="pass --torch_compile to train_clip.py")
    parser.add_argument(
        "--time_budget_s",
        type=float,
        default=530,
        help="wall clock for all runs; the rest share what is left",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="runs sharing the GPU at once (each ViT-B/16 run needs ~25 GiB); samples/s is then not comparable",
    )
    parser.add_argument("--runs_dir", default=None, help="train_clip output dirs (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke test: tiny model, few steps")
    parser.add_argument(
        "--drop_loss",
        type=float,
        default=DROP_LOSS,
        help="date each run's loss drop by the first step whose smoothed loss reaches this level",
    )
    parser.add_argument(
        "--merge", nargs="+", default=None, help="re-summarize these parity.json files, no runs"
    )
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more train_clip.py flags")
    args = parser.parse_args()
    args.extra = [a for a in args.extra if a != "--"]
    if args.parallel < 1:
        parser.error("--parallel must be >= 1")
    out_dir = Path(args.out_dir)

    if args.merge:
        loaded = [json.loads(Path(p).read_text()) for p in args.merge]
        runs = [run for data in loaded for run in data["runs"]]
        env = dict(loaded[0]["env"])
        steps = sorted({data["env"].get("steps") for data in loaded}, key=str)
        if len(steps) > 1:  # the header names one schedule; pairs stay within theirs (data_order)
            env["steps"] = "mixed (" + " / ".join(map(str, steps)) + ")"
        write_outputs(runs, env, out_dir, args.drop_loss)
        print((out_dir / "parity.md").read_text())
        return

    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="parity_runs_"))
    config = MODEL_CONFIG
    if args.smoke:
        args.steps, args.batch_size, args.warmup_steps = min(args.steps, 4), 8, 1
        args.num_workers, args.eval_samples, args.eval_steps, args.logging_steps = 0, 16, 2, 1
        args.mixed_precision = "no"
        runs_dir.mkdir(parents=True, exist_ok=True)
        config = tiny_config(runs_dir)
    env = environment(args, config)
    plan = [(seed, variant) for seed in args.seeds for variant in args.variants]
    start = time.perf_counter()
    runs = []
    for first in range(0, len(plan), args.parallel):
        wave = plan[first : first + args.parallel]
        left = args.time_budget_s - (time.perf_counter() - start) - SETUP_RESERVE_S
        # an equal share of what is left per wave, so one slow wave cannot starve all the later ones
        share = left / math.ceil((len(plan) - first) / args.parallel)
        with ThreadPoolExecutor(max_workers=len(wave)) as pool:
            futures = [
                pool.submit(one_run, args, seed, variant, runs_dir, config, share) for seed, variant in wave
            ]
            done = [future.result() for future in futures]
        for run in done:
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k not in ("train", "evals")}), flush=True)
        # after every wave (the last one's are the final outputs): a killed command keeps what finished
        write_outputs(runs, env, out_dir, args.drop_loss)
    print((out_dir / "parity.md").read_text())


if __name__ == "__main__":
    main()
