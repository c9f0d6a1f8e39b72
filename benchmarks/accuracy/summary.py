"""Runs paired with bf16: 95% t intervals of the differences, verdicts and the tables (parity.md).

A run pairs with the finished bf16 run of the same `pair_key`. "Final loss" is the mean over the last 20% of
logged steps. Per run, the drop steps date when its smoothed loss crossed fractions of its way down, so that
runs which split into early and late escapes from a plateau show as a large spread.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from common import mean_se, t95

from .graded_run import ARCHS

BOUND_PP = 0.5
MIN_PAIRS = 5
METRICS = ("zero_shot_top1", "caption_r1")  # fractions in the records, pp in the table
DROP_FRACTIONS = (0.5, 0.8, 0.9)
LAST_FRACTION = 0.2
# what fixes a run's start weights, batches and schedule: runs pair with bf16 only when all are equal
PAIR_FIELDS = ("protocol", "task", "seed", "batch_size", "lr", "warmup", "arch", "init_id", "eval_samples")


def tail_window(train: list[dict]) -> list[dict]:
    return train[-max(1, math.ceil(len(train) * LAST_FRACTION)) :]


def final_loss(run: dict) -> float | None:
    return mean_se([x["loss"] for x in tail_window(run["train"])])[0] if run["train"] else None


def ema_of(values: list[float], decay: float = 0.8) -> list[float]:
    """The loss curve smoothed (an EMA), as drop_step reads it."""
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
    """PAIR_FIELDS and the step count trained (also where the spec said steps="auto")."""
    return (*(run["spec"].get(k) for k in PAIR_FIELDS), run.get("steps", run["spec"].get("steps")))


def interval(diffs: list[float]) -> dict:
    """Mean, SE and two-sided 95% Student t interval of paired differences (None where undefined)."""
    mean, se = mean_se(diffs)
    half = None if se is None else t95(len(diffs) - 1) * se
    low, high = (None, None) if half is None else (mean - half, mean + half)
    return dict(n=len(diffs), mean=mean, se=se, low=low, high=high)


def verdict(iv: dict, bound: float = BOUND_PP) -> str:
    """Read a paired-difference interval (pp) against +-bound: resolved when it lies inside or outside."""
    if iv["n"] < MIN_PAIRS or iv["low"] is None:
        return f"not resolved ({iv['n']} pairs; needs >= {MIN_PAIRS})"
    span = f"95% interval {iv['low']:+.2f} to {iv['high']:+.2f} pp"
    if -bound <= iv["low"] and iv["high"] <= bound:
        return f"**parity within ±{bound} pp** ({span})"
    if iv["high"] < -bound:
        return f"**worse by more than {bound} pp** ({span})"
    if iv["low"] > bound:
        return f"**better by more than {bound} pp** ({span})"
    return f"not resolved ({span})"


def _row(r: dict, base: dict | None) -> dict:
    s, ok = r["spec"], r.get("status") == "ok"
    row = {k: s[k] for k in ("name", "protocol", "variant", "seed")} | dict(status=r.get("status"))
    row["final_loss"] = final_loss(r)
    row.update({k: (r.get("results") or {}).get(k) for k in METRICS})
    row["wall_s"], row["train_s"] = r.get("wall_s"), r.get("train_s")
    last = (r["train"] or [{"step": 0}])[-1]["step"]  # a killed run: its last logged step
    row["steps"] = r.get("steps") if ok else last
    if base is not None and base is not r and ok:
        for key in METRICS:
            row[f"d_{key}"] = 100.0 * (r["results"][key] - base["results"][key])
        base_loss = {x["step"]: x["loss"] for x in base["train"]}
        diffs = [x["loss"] - base_loss[x["step"]] for x in tail_window(r["train"]) if x["step"] in base_loss]
        row["d_final_loss"] = mean_se(diffs)[0]
    return row


def _drop_spreads(runs: list[dict], protocol: str) -> list[dict]:
    """Per variant and fraction f: the steps at which runs crossed ln(batch) - f (ln(batch) - bf16's final loss)
    (a contrastive loss starts near ln(batch))."""
    mine = [r for r in runs if r["spec"]["protocol"] == protocol and r.get("status") == "ok" and r["train"]]
    ends = [final_loss(r) for r in mine if r["spec"]["variant"] == "bf16"]
    if not ends:
        return []
    start, end = math.log(mine[0]["spec"]["batch_size"]), sum(ends) / len(ends)
    out = []
    for variant in dict.fromkeys(r["spec"]["variant"] for r in mine):
        for f in DROP_FRACTIONS:
            level = start - f * (start - end)
            steps = [drop_step(r["train"], level) for r in mine if r["spec"]["variant"] == variant]
            values = [s for s in steps if s is not None]
            if values:
                mean, se = mean_se(values)
                sd = None if se is None else se * math.sqrt(len(values))
                out.append(
                    dict(protocol=protocol, variant=variant, fraction=f, level=level, n=len(values),
                         never=len(steps) - len(values), min=min(values), max=max(values), mean=mean, sd=sd)
                )  # fmt: skip
    return out


def summarize(runs: list[dict]) -> dict:
    """Rows per run, pooled paired differences per (protocol, variant), and drop-step spreads."""
    bf16 = {pair_key(r): r for r in runs if r["spec"]["variant"] == "bf16" and r.get("status") == "ok"}
    rows = [_row(r, bf16.get(pair_key(r))) for r in runs]
    pools, protocols = [], list(dict.fromkeys(r["protocol"] for r in rows))
    pairs = sorted(
        dict.fromkeys((r["protocol"], r["variant"]) for r in rows), key=lambda k: protocols.index(k[0])
    )
    for protocol, variant in pairs:
        mine = [
            r
            for r in rows
            if (r["protocol"], r["variant"], "d_zero_shot_top1" in r) == (protocol, variant, True)
        ]
        if variant == "bf16" or not mine:
            continue
        pool = dict(protocol=protocol, variant=variant)
        for key in ("d_zero_shot_top1", "d_caption_r1", "d_final_loss"):
            pool[key] = interval([r[key] for r in mine if r.get(key) is not None])
        pool["verdict_zero_shot"] = verdict(pool["d_zero_shot_top1"])
        pool["verdict_caption_r1"] = verdict(pool["d_caption_r1"])
        pools.append(pool)
    spreads = [x for p in dict.fromkeys(r["spec"]["protocol"] for r in runs) for x in _drop_spreads(runs, p)]
    return dict(rows=rows, pooled=pools, drop_spread=spreads)


def _f(value, spec=".2f") -> str:
    return "-" if value is None else format(value, spec)


def _iv(iv: dict, spec="+.2f") -> str:
    if iv["mean"] is None or iv["low"] is None:
        return _f(iv["mean"], spec)
    return f"{iv['mean']:{spec}} ({iv['low']:{spec}} to {iv['high']:{spec}})"


def _pct(x) -> str:
    return _f(x and 100 * x)


def markdown(summary: dict, env: dict) -> str:
    arch = env.get("arch")
    lines = [
        f"Parity: {env.get('device', 'cpu')}, torch {env.get('torch')}, arch {arch} ({ARCHS.get(arch, {})}), "
        f"batch {env.get('batch_size')}, eval on {env.get('eval_samples')} images.",
        "",
        "Paired differences to bf16 (same seed: same start weights and batches), mean and 95% Student t interval:",
        "",
        "| protocol | variant | pairs | Δ zero-shot pp | Δ image→caption R@1 pp | Δ final loss | verdict (zero-shot, ±0.5 pp) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for p in summary["pooled"]:
        zs = p["d_zero_shot_top1"]
        lines.append(
            f"| {p['protocol']} | {p['variant']} | {zs['n']} | {_iv(zs)} | {_iv(p['d_caption_r1'])} "
            f"| {_iv(p['d_final_loss'], '+.4f')} | {p['verdict_zero_shot']} |"
        )
    lines += [
        "",
        "| protocol | variant | seed | status | steps | final loss (last 20%) | zero-shot | Δ pp | R@1 | Δ pp | train s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["rows"]:
        lines.append(
            f"| {r['protocol']} | {r['variant']} | {r['seed']} | {r['status']} | {r['steps']} "
            f"| {_f(r['final_loss'], '.4f')} | {_pct(r['zero_shot_top1'])} | {_f(r.get('d_zero_shot_top1'), '+.2f')} "
            f"| {_pct(r['caption_r1'])} | {_f(r.get('d_caption_r1'), '+.2f')} | {_f(r['train_s'], '.0f')} |"
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
    if env.get("eval_samples"):
        lines += [
            "",
            f"One accuracy's binomial SE on {env['eval_samples']} images: at most {50 / math.sqrt(env['eval_samples']):.2f} pp.",
        ]
    return "\n".join(lines) + "\n"


def write_outputs(runs: list[dict], env: dict, out_dir: Path) -> dict:
    """parity.json (env, summary, runs: what --merge reads) and parity.md in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(runs)
    (out_dir / "parity.json").write_text(json.dumps(dict(env=env, summary=summary, runs=runs)))
    (out_dir / "parity.md").write_text(markdown(summary, env))
    return summary
