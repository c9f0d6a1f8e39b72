"""Aggregate the runs of benchmarks/multi_gpu.sh into summary.json and summary.md.

    python benchmarks/multi_gpu_summary.py WORK_DIR OUT_DIR

Reads WORK_DIR/runs.tsv (name, exit code, seconds) and each run's all_results.json / train_log.jsonl; loads
every final model of the resume checks with plain transformers (a subprocess that never imports hf_switchback).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

LOAD_CHECK = """
import json, sys
import torch
from transformers import CLIPModel
model, info = CLIPModel.from_pretrained(sys.argv[1], output_loading_info=True)
assert "hf_switchback" not in sys.modules
print(json.dumps({
    "loaded": True,
    "logit_scale_shape": list(model.logit_scale.shape),
    "missing_keys": len(info["missing_keys"]),
    "unexpected_keys": len(info["unexpected_keys"]),
    "mismatched_keys": len(info["mismatched_keys"]),
    "class": type(model).__name__,
}))
"""


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def max_abs_diff(a: dict[int, float], b: dict[int, float], steps) -> float | None:
    common = [s for s in steps if s in a and s in b]
    return max(abs(a[s] - b[s]) for s in common) if common else None


def resumed_step(log_path: str) -> int | None:
    """The step of the checkpoint a launch resumed from (its `resuming from .../step_N` line), else None."""
    if not os.path.exists(log_path):
        return None
    with open(log_path, errors="replace") as f:
        found = re.findall(r"resuming from \S*step_(\d+)", f.read())
    return int(found[-1]) if found else None


def load_check(model_dir: str) -> dict:
    if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
        return {"loaded": False, "error": "no model.safetensors"}
    env = {k: v for k, v in os.environ.items()}
    # plain transformers: leave our src/ off the path so a stray import would fail loudly
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if "src" not in p
    )
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_CHECK, model_dir], capture_output=True, text=True, env=env, timeout=90
    )
    if proc.returncode != 0:
        return {"loaded": False, "error": proc.stderr.strip().splitlines()[-1:] or ["?"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(work: str, out: str) -> None:
    runs = {}
    with open(os.path.join(work, "runs.tsv")) as f:
        for line in f:
            name, rc, seconds = line.rstrip("\n").split("\t")
            runs[name] = {"rc": rc, "seconds": int(seconds)}
    summary: dict = {"runs": {}}
    for name, run in runs.items():
        results_path = os.path.join(work, name, "all_results.json")
        results = {}
        if os.path.exists(results_path):
            with open(results_path) as f:
                results = json.load(f)
        keep = (
            "train_samples_per_second_steady",
            "train_samples_per_second",
            "peak_memory_allocated_gib",
            "peak_memory_reserved_gib",
            "peak_memory_allocated_gib_per_rank",
            "global_batch_size",
            "num_processes",
            "distributed_type",
            "train_loss",
            "train_steps",
        )
        summary["runs"][name] = {**run, **{k: results.get(k) for k in keep if k in results}}

    def steady(name):
        return summary["runs"].get(name, {}).get("train_samples_per_second_steady")

    # a. scaling efficiency: throughput(N) / (N x throughput(1))
    scaling = {}
    for kind in ("int8", "bf16"):
        one = steady(f"ddp_{kind}_1gpu")
        for n in (1, 2, 4):
            value = steady(f"ddp_{kind}_{n}gpu")
            if value is not None:
                scaling[f"{kind}_{n}gpu"] = {
                    "samples_per_s": round(value, 1),
                    "per_gpu": round(value / n, 1),
                    "efficiency": round(value / (n * one), 3) if one else None,
                }
    if steady("ddp_int8_4gpu") and steady("ddp_bf16_4gpu"):
        scaling["int8_over_bf16_4gpu"] = round(steady("ddp_int8_4gpu") / steady("ddp_bf16_4gpu"), 3)
    if steady("ddp_int8_1gpu") and steady("ddp_bf16_1gpu"):
        scaling["int8_over_bf16_1gpu"] = round(steady("ddp_int8_1gpu") / steady("ddp_bf16_1gpu"), 3)
    summary["scaling"] = scaling

    # b. same loss: 1 GPU x 2B vs 2 GPUs x B
    one = train_losses(read_jsonl(os.path.join(work, "same_loss_1gpu", "train_log.jsonl")))
    two = train_losses(read_jsonl(os.path.join(work, "same_loss_2gpu", "train_log.jsonl")))
    steps = sorted(set(one) & set(two))
    summary["same_loss"] = {
        "steps_compared": len(steps),
        "loss_step1": [one.get(1), two.get(1)],
        "max_abs_diff_step1": max_abs_diff(one, two, [1]),
        "max_abs_diff_all": max_abs_diff(one, two, steps),
        "loss_1gpu": [one[s] for s in steps],
        "loss_2gpu": [two[s] for s in steps],
    }

    # c. checkpoint + resume + plain load
    resume = {}
    for name in ("fsdp2", "deepspeed_zero2", "deepspeed_zero3"):
        first = train_losses(read_jsonl(os.path.join(work, name, "train_log_first.jsonl")))
        second = train_losses(read_jsonl(os.path.join(work, name, "train_log.jsonl")))
        ckpt_step = resumed_step(os.path.join(work, f"{name}_resumed.log"))
        rerun = [s for s in second if ckpt_step is not None and s > ckpt_step and s in first]
        entry = {
            "first_rc": runs.get(name, {}).get("rc"),
            "resumed_rc": runs.get(f"{name}_resumed", {}).get("rc"),
            "losses_first": [first[s] for s in sorted(first)],
            "resumed_from_step": ckpt_step,
            "steps_rerun": len(rerun),
            "max_abs_loss_diff_after_resume": max_abs_diff(first, second, rerun),
        }
        if entry["resumed_rc"] == "0":
            entry["plain_load"] = load_check(os.path.join(work, name))
        resume[name] = entry
    summary["resume"] = resume

    # d. logit memory
    runs = summary["runs"]
    local_name = next((n for n in runs if n.startswith("logits_local_")), None)
    global_name = next((n for n in runs if n.startswith("logits_global_")), None)
    local = runs.get(local_name, {}).get("peak_memory_allocated_gib")
    glob = runs.get(global_name, {}).get("peak_memory_allocated_gib")
    summary["logit_memory"] = {
        "local_loss_gib": local,
        "global_loss_gib": glob,
        "global_over_local": round(glob / local, 2) if local and glob else None,
        "global_batch": runs.get(local_name, {}).get("global_batch_size"),
    }

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    lines = [
        "| run | rc | s | global batch | steady samples/s | peak alloc GiB (max rank) | train loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in summary["runs"].items():
        sps = r.get("train_samples_per_second_steady")
        loss = r.get("train_loss")
        lines.append(
            f"| {name} | {r['rc']} | {r['seconds']} | {r.get('global_batch_size', '')} | "
            f"{'' if sps is None else f'{sps:.1f}'} | {r.get('peak_memory_allocated_gib', '')} | "
            f"{'' if loss is None else f'{loss:.4f}'} |"
        )
    lines += ["", "scaling: " + json.dumps(scaling), "", "same loss: " + json.dumps(summary["same_loss"])]
    lines += ["", "resume: " + json.dumps(resume), "", "logit memory: " + json.dumps(summary["logit_memory"])]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "work_dir", help="benchmarks/multi_gpu.sh's WORK folder (runs.tsv and one folder per run)"
    )
    parser.add_argument("out_dir", help="summary.json and summary.md go here")
    args = parser.parse_args()
    main(args.work_dir, args.out_dir)
