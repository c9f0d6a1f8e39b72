"""Aggregate the runs of benchmarks/multi_gpu.sh into summary.json and summary.md.

    python benchmarks/multi_gpu_summary.py WORK_DIR OUT_DIR

Reads WORK_DIR/runs.tsv (name, exit code, seconds) and each run's all_results.json / train_log.jsonl; loads
every final model of the resume checks with plain transformers (a subprocess that never imports hf_switchback).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

LOAD_CHECK = """
import json, sys
from transformers import CLIPModel
model, info = CLIPModel.from_pretrained(sys.argv[1], output_loading_info=True)
assert "hf_switchback" not in sys.modules
keys = {k: len(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
print(json.dumps({"loaded": True, "logit_scale_shape": list(model.logit_scale.shape), "class": type(model).__name__, **keys}))
"""
KEEP = ("train_samples_per_second_steady", "train_samples_per_second", "peak_memory_allocated_gib")
KEEP += ("peak_memory_reserved_gib", "peak_memory_allocated_gib_per_rank", "global_batch_size")
KEEP += ("num_processes", "distributed_type", "train_loss", "train_steps")


def losses(path: Path) -> dict[int, float]:
    """step -> loss of a train_log.jsonl ({} if it is missing)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["step"]: r["loss"] for r in map(json.loads, filter(str.strip, lines)) if "loss" in r}


def max_abs_diff(a: dict, b: dict, steps) -> float | None:
    both = [s for s in steps if s in a and s in b]
    return max(abs(a[s] - b[s]) for s in both) if both else None


def resumed_step(log: Path) -> int | None:
    """The step of the checkpoint a launch resumed from (its `resuming from .../step_N` line), else None."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = re.findall(r"resuming from \S*step_(\d+)", text)
    return int(found[-1]) if found else None


def load_check(model_dir: Path) -> dict:
    if not (model_dir / "model.safetensors").exists():
        return {"loaded": False, "error": "no model.safetensors"}
    # plain transformers: our src/ off the path, so a stray import fails loudly
    path = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if "src" not in p)
    command = [sys.executable, "-c", LOAD_CHECK, str(model_dir)]
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=90)
    if proc.returncode != 0:
        return {"loaded": False, "error": proc.stderr.strip().splitlines()[-1:] or ["?"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(work: Path) -> dict:
    runs = {}
    for line in (work / "runs.tsv").read_text().splitlines():
        name, rc, seconds = line.split("\t")
        results = work / name / "all_results.json"
        results = json.loads(results.read_text()) if results.exists() else {}
        runs[name] = dict(rc=rc, seconds=int(seconds), **{k: results[k] for k in KEEP if k in results})
    steady = lambda name: runs.get(name, {}).get("train_samples_per_second_steady")  # noqa: E731
    scaling = {}  # a. throughput(N) / (N x throughput(1))
    for kind in ("int8", "bf16"):
        one = steady(f"ddp_{kind}_1gpu")
        for n in (1, 2, 4):
            if (value := steady(f"ddp_{kind}_{n}gpu")) is not None:
                efficiency = round(value / (n * one), 3) if one else None
                entry = dict(samples_per_s=round(value, 1), per_gpu=round(value / n, 1))
                scaling[f"{kind}_{n}gpu"] = dict(entry, efficiency=efficiency)
    for n in (1, 4):
        if steady(f"ddp_int8_{n}gpu") and steady(f"ddp_bf16_{n}gpu"):
            ratio = steady(f"ddp_int8_{n}gpu") / steady(f"ddp_bf16_{n}gpu")
            scaling[f"int8_over_bf16_{n}gpu"] = round(ratio, 3)
    # b. same loss: 1 GPU x 2B vs 2 GPUs x B
    one, two = (losses(work / f"same_loss_{n}gpu" / "train_log.jsonl") for n in (1, 2))
    steps = sorted(set(one) & set(two))
    same = dict(steps_compared=len(steps), loss_step1=[one.get(1), two.get(1)])
    same.update(max_abs_diff_step1=max_abs_diff(one, two, [1]))
    same["max_abs_diff_all"] = max_abs_diff(one, two, steps)
    same.update(loss_1gpu=[one[s] for s in steps], loss_2gpu=[two[s] for s in steps])
    resume = {}  # c. checkpoint + resume + plain load
    for name in ("fsdp2", "deepspeed_zero2", "deepspeed_zero3"):
        first, second = losses(work / name / "train_log_first.jsonl"), losses(work / name / "train_log.jsonl")
        ckpt = resumed_step(work / f"{name}_resumed.log")
        rerun = [s for s in second if ckpt is not None and s > ckpt and s in first]
        entry = dict(first_rc=runs.get(name, {}).get("rc"), losses_first=[first[s] for s in sorted(first)])
        entry.update(resumed_rc=runs.get(f"{name}_resumed", {}).get("rc"), resumed_from_step=ckpt)
        entry["steps_rerun"] = len(rerun)
        entry["max_abs_loss_diff_after_resume"] = max_abs_diff(first, second, rerun)
        if entry["resumed_rc"] == "0":
            entry["plain_load"] = load_check(work / name)
        resume[name] = entry
    # d. logit memory
    first_of = lambda kind: next((runs[n] for n in runs if n.startswith(f"logits_{kind}_")), {})  # noqa: E731
    local, glob = first_of("local"), first_of("global")
    local_gib, global_gib = local.get("peak_memory_allocated_gib"), glob.get("peak_memory_allocated_gib")
    ratio = round(global_gib / local_gib, 2) if local_gib and global_gib else None
    logits = dict(local_loss_gib=local_gib, global_loss_gib=global_gib, global_over_local=ratio)
    logits["global_batch"] = local.get("global_batch_size")
    return dict(runs=runs, scaling=scaling, same_loss=same, resume=resume, logit_memory=logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("work_dir", type=Path, help="multi_gpu.sh's WORK folder (runs.tsv, a folder per run)")
    parser.add_argument("out_dir", type=Path, help="summary.json and summary.md go here")
    args = parser.parse_args()
    summary = summarize(args.work_dir)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = ["| run | rc | s | global batch | steady samples/s | peak alloc GiB (max rank) | train loss |"]
    lines.append("|---|---|---|---|---|---|---|")
    for name, r in summary["runs"].items():
        sps, loss = r.get("train_samples_per_second_steady"), r.get("train_loss")
        cells = [name, r["rc"], r["seconds"], r.get("global_batch_size", ""), f"{sps:.1f}" if sps else ""]
        cells += [r.get("peak_memory_allocated_gib", ""), "" if loss is None else f"{loss:.4f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    for key in ("scaling", "same_loss", "resume", "logit_memory"):
        lines += ["", f"{key.replace('_', ' ')}: {json.dumps(summary[key])}"]
    (args.out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
