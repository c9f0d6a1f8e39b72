"""The accuracy harness's summary: runs paired with bf16, 95% t intervals, verdicts, the table and the plot.

A run pairs with the finished bf16 run of the same `pair_key` (protocol, task, seed, schedule, model, start
weights, eval set, data order and the step count it trained with). Per (protocol, variant): the mean paired
difference of zero-shot top-1, image->caption R@1 (pp) and final loss (the mean over the last 20% of logged
steps), each with its two-sided 95% Student t interval, and the verdict against +-BOUND_PP; per run, the first
logged steps at which its smoothed loss crossed fixed fractions of its way down (early vs late escapes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from common import mean_se, t95

from .graded_run import ARCHS

BOUND_PP = 0.5
METRICS = (("zero_shot_top1", "zero-shot top-1", 100.0), ("caption_r1", "image→caption R@1", 100.0))
DROP_FRACTIONS = (0.5, 0.8, 0.9)
LAST_FRACTION = 0.2  # "final loss" = mean over the last 20% of logged steps


def tail_window(train: list[dict]) -> list[dict]:
    """The last LAST_FRACTION of logged training steps (at least one): the window of "final loss"."""
    return train[-max(1, math.ceil(len(train) * LAST_FRACTION)) :]


def final_loss(run: dict) -> float | None:
    return mean_se([x["loss"] for x in tail_window(run["train"])])[0] if run["train"] else None


def ema_of(values: list[float], decay: float = 0.8) -> list[float]:
    """The loss curve smoothed as plotted (exponential moving average)."""
    out, ema = [], values[0]
    for v in values:
        ema = decay * ema + (1 - decay) * v
        out.append(ema)
    return out


def drop_step(train: list[dict], level: float) -> int | None:
    """First logged step whose smoothed loss is at or below `level`; None if never."""
    smoothed = ema_of([x["loss"] for x in train]) if train else []
    return next((x["step"] for x, s in zip(train, smoothed, strict=True) if s <= level), None)


def pair_key(run: dict) -> tuple:
    """What fixes a run's weights at start, batches and schedule: runs pair with bf16 only when all are equal
    (the step count is the one the run trained with, also when its spec said "auto")."""
    spec = run["spec"]
    keys = (
        "protocol",
        "task",
        "seed",
        "batch_size",
        "lr",
        "warmup",
        "arch",
        "init_id",
        "eval_samples",
        "data_order",
    )
    return (*(spec.get(k) for k in keys), run.get("steps", spec.get("steps")))


def interval(diffs: list[float]) -> dict:
    """Mean, SE and two-sided 95% Student t interval of paired differences (None where undefined)."""
    mean, se = mean_se(diffs)
    out = dict(n=len(diffs), mean=mean, se=se, low=None, high=None)
    if se is not None:
        half = t95(len(diffs) - 1) * se
        out.update(low=mean - half, high=mean + half)
    return out


def verdict(iv: dict, bound: float = BOUND_PP, min_pairs: int = 5) -> str:
    """Read a paired-difference interval (pp) against +-bound: resolved when it lies inside or outside."""
    if iv["n"] < min_pairs or iv["low"] is None:
        return f"not resolved ({iv['n']} pairs; needs >= {min_pairs})"
    span = f"95% interval {iv['low']:+.2f} to {iv['high']:+.2f} pp"
    if -bound <= iv["low"] and iv["high"] <= bound:
        return f"**parity within ±{bound} pp** ({span})"
    if iv["high"] < -bound:
        return f"**worse by more than {bound} pp** ({span})"
    if iv["low"] > bound:
        return f"**better by more than {bound} pp** ({span})"
    return f"not resolved ({span})"


def drop_steps(run: dict, start: float, end: float) -> dict:
    """Per fraction f of DROP_FRACTIONS: first logged step whose smoothed loss is below start - f (start - end)."""
    out = {}
    for f in DROP_FRACTIONS:
        out[f] = drop_step(run["train"], start - f * (start - end))
    return out


def summarize(runs: list[dict]) -> dict:
    """Rows per run, pooled paired differences per (protocol, variant), and drop-step spreads."""
    bf16 = {}
    for r in runs:
        if r["spec"]["variant"] == "bf16" and r.get("status") == "ok":
            bf16[pair_key(r)] = r
    rows = []
    for r in runs:
        s = r["spec"]
        row = dict(
            name=s["name"],
            protocol=s["protocol"],
            variant=s["variant"],
            seed=s["seed"],
            status=r.get("status"),
        )
        row["final_loss"] = final_loss(r)
        row.update({k: (r.get("results") or {}).get(k) for k, _, _ in METRICS})
        row["wall_s"], row["train_s"] = r.get("wall_s"), r.get("train_s")
        # the count trained; a killed run's last logged step
        row["steps"] = (
            r.get("steps") if r.get("status") == "ok" else (r["train"] or [{"step": 0}])[-1]["step"]
        )
        base = bf16.get(pair_key(r))
        if base is not None and base is not r and r.get("status") == "ok":
            for key, _, scale in METRICS:
                row[f"d_{key}"] = scale * (r["results"][key] - base["results"][key])
            base_loss = {x["step"]: x["loss"] for x in base["train"]}
            window = tail_window(r["train"])
            diffs = [x["loss"] - base_loss[x["step"]] for x in window if x["step"] in base_loss]
            row["d_final_loss"] = mean_se(diffs)[0]
        rows.append(row)
    pools = []
    for protocol in dict.fromkeys(r["protocol"] for r in rows):
        for variant in dict.fromkeys(r["variant"] for r in rows if r["protocol"] == protocol):
            mine = [
                r
                for r in rows
                if r["protocol"] == protocol and r["variant"] == variant and "d_zero_shot_top1" in r
            ]
            if variant == "bf16" or not mine:
                continue
            pool = dict(protocol=protocol, variant=variant)
            for key in ("d_zero_shot_top1", "d_caption_r1", "d_final_loss"):
                pool[key] = interval([r[key] for r in mine if r.get(key) is not None])
            pool["verdict_zero_shot"] = verdict(pool["d_zero_shot_top1"])
            pool["verdict_caption_r1"] = verdict(pool["d_caption_r1"])
            pools.append(pool)
    spreads = []
    for protocol in dict.fromkeys(r["spec"]["protocol"] for r in runs):
        mine = [
            r for r in runs if r["spec"]["protocol"] == protocol and r.get("status") == "ok" and r["train"]
        ]
        ends = [final_loss(r) for r in mine if r["spec"]["variant"] == "bf16"]
        if not ends:
            continue
        start = math.log(mine[0]["spec"]["batch_size"])  # a contrastive loss starts near ln(batch)
        end = sum(ends) / len(ends)
        for variant in dict.fromkeys(r["spec"]["variant"] for r in mine):
            steps = [drop_steps(r, start, end) for r in mine if r["spec"]["variant"] == variant]
            for f in DROP_FRACTIONS:
                values = [s[f] for s in steps if s[f] is not None]
                never = len(steps) - len(values)
                if values:
                    mean, se = mean_se(values)
                    sd = None if se is None else se * math.sqrt(len(values))
                    spreads.append(
                        dict(protocol=protocol, variant=variant, fraction=f, level=start - f * (start - end),
                             n=len(values), never=never, min=min(values), max=max(values), mean=mean, sd=sd)
                    )  # fmt: skip
    return dict(rows=rows, pooled=pools, drop_spread=spreads)


def _f(value, spec=".2f") -> str:
    return "-" if value is None else format(value, spec)


def _iv(iv: dict, spec="+.2f") -> str:
    if iv["mean"] is None:
        return "-"
    if iv["low"] is None:
        return _f(iv["mean"], spec)
    return f"{iv['mean']:{spec}} ({iv['low']:{spec}} to {iv['high']:{spec}})"


def markdown(summary: dict, env: dict) -> str:
    lines = [
        f"Parity: {env.get('device', 'cpu')}, torch {env.get('torch')}, arch {env.get('arch')} "
        f"({ARCHS.get(env.get('arch'), {})}), batch {env.get('batch_size')}, eval on {env.get('eval_samples')} images.",
        "",
        "Paired differences to bf16 (same seed: same start weights and batches), mean and 95% Student t interval:",
        "",
        "| protocol | variant | pairs | Δ zero-shot pp | Δ image→caption R@1 pp | Δ final loss | verdict (zero-shot, ±0.5 pp) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for p in summary["pooled"]:
        lines.append(
            f"| {p['protocol']} | {p['variant']} | {p['d_zero_shot_top1']['n']} | {_iv(p['d_zero_shot_top1'])} "
            f"| {_iv(p['d_caption_r1'])} | {_iv(p['d_final_loss'], '+.4f')} | {p['verdict_zero_shot']} |"
        )
    lines += [
        "",
        "| protocol | variant | seed | status | steps | final loss (last 20%) | zero-shot | Δ pp | R@1 | Δ pp | train s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["rows"]:
        lines.append(
            f"| {r['protocol']} | {r['variant']} | {r['seed']} | {r['status']} | {r['steps']} "
            f"| {_f(r['final_loss'], '.4f')} "
            f"| {_f(r['zero_shot_top1'] and 100 * r['zero_shot_top1'])} | {_f(r.get('d_zero_shot_top1'), '+.2f')} "
            f"| {_f(r['caption_r1'] and 100 * r['caption_r1'])} | {_f(r.get('d_caption_r1'), '+.2f')} "
            f"| {_f(r['train_s'], '.0f')} |"
        )
    if summary["drop_spread"]:
        lines += [
            "",
            "When the smoothed loss (EMA 0.8) first crossed a fraction of its way from ln(batch) to bf16's final "
            "loss (a bimodal escape shows as a large spread or 'never'):",
            "",
            "| protocol | variant | fraction (level) | runs | never | first step: min / mean / max | SD |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for s in summary["drop_spread"]:
            lines.append(
                f"| {s['protocol']} | {s['variant']} | {s['fraction']} ({s['level']:.3f}) | {s['n']} | {s['never']} "
                f"| {s['min']} / {s['mean']:.0f} / {s['max']} | {_f(s['sd'], '.0f')} |"
            )
    n = env.get("eval_samples") or 0
    if n:
        lines += ["", f"One accuracy's binomial SE on {n} images: at most {50 / math.sqrt(n):.2f} pp."]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> bool:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    protocols = list(dict.fromkeys(r["spec"]["protocol"] for r in runs))
    fig = Figure(figsize=(6.5 * len(protocols), 4.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(protocols), squeeze=False)[0]
    colors = {"bf16": "tab:blue", "int8": "tab:orange", "fp8": "tab:green", "int8-int8grad": "tab:red"}
    for ax, protocol in zip(axes, protocols, strict=True):
        seen = set()
        for r in runs:
            if r["spec"]["protocol"] != protocol or not r["train"]:
                continue
            v = r["spec"]["variant"]
            xs = [x["step"] for x in r["train"]]
            ys = ema_of([x["loss"] for x in r["train"]])
            ax.plot(
                xs, ys, color=colors.get(v, "gray"), alpha=0.6, linewidth=0.9, label=None if v in seen else v
            )
            seen.add(v)
        ax.set(title=f"{protocol}: training loss (EMA 0.8), one line per seed", xlabel="step", ylabel="loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def write_outputs(runs: list[dict], env: dict, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(runs)
    (out_dir / "parity.json").write_text(json.dumps(dict(env=env, summary=summary, runs=runs)))
    text = markdown(summary, env)
    if not plot(runs, out_dir / "parity_loss.png"):
        text += "\n(no plot: matplotlib is not installed here; re-plot with --merge parity.json)\n"
    (out_dir / "parity.md").write_text(text)
    return summary
