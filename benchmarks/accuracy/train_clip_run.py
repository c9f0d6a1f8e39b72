"""The train_clip protocol of the accuracy harness: one examples/train_clip.py process per (variant, seed).

`train_clip_run(spec)` runs the training script itself (ViT-B/16 from examples/configs by default, the embedded
synthetic set, its DataLoader workers) and reads its train_log.jsonl and all_results.json into the harness's
record; `from_train_clip_harness` reads the records of the harness's earlier ViT-B/16-only form for --merge.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from .graded_run import SWITCHBACK_FIELDS

ROOT = Path(__file__).resolve().parents[2]
TRAIN_CLIP = ROOT / "examples" / "train_clip.py"
VIT_B16 = ROOT / "examples" / "configs" / "clip-vit-b-16.json"


def run_dir_of(spec: dict) -> Path:
    """Where a train_clip run writes (by name: warm-up runs get their own)."""
    return Path(spec["runs_dir"]) / spec["name"]


def train_clip_command(spec: dict, run_dir: Path) -> list[str]:
    """The train_clip.py command line of one run."""
    import torch

    # min_tokens 0: a parity run measures the 8-bit path; with the default floor the measured crossover table
    # (kernels/crossover) would keep most layers 16-bit on Hopper and compare bf16 with itself
    flags = (
        ["--switchback", "off"] if spec["variant"] == "bf16" else ["--switchback", "on", "--min_tokens", "0"]
    )
    for field, value in SWITCHBACK_FIELDS.get(spec["variant"], {}).items():
        flags += [f"--{field}"] if value is True else [f"--{field}", str(value)]
    steps, batch = spec["steps"], spec["batch_size"]
    numbers = dict(
        seed=spec["seed"], batch_size=batch, max_train_steps=steps, lr=spec["lr"], warmup_steps=spec["warmup"],
        synthetic_train_samples=steps * batch,  # one epoch: no loader restart
        num_workers=spec["num_workers"], max_eval_samples=spec["eval_samples"], logging_steps=spec["log_every"],
        eval_steps=spec["eval_every"], mixed_precision="bf16" if torch.cuda.is_available() else "no",
    )  # fmt: skip
    cmd = [sys.executable, str(TRAIN_CLIP), "--model_config", spec["model_config"], *flags]
    cmd += [word for key, value in numbers.items() for word in (f"--{key}", str(value))]
    return [*cmd, "--output_dir", str(run_dir), "--overwrite_output_dir", "--report_to", "none"]


def read_train_log(path: Path) -> tuple[list[dict], list[dict]]:
    """(training lines, eval lines) of a train_log.jsonl; eval lines are the ones without a loss."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [x for x in lines if "loss" in x], [x for x in lines if "loss" not in x]


def train_clip_results(results: dict) -> dict:
    """train_clip's all_results.json in this harness's metrics (its own figures kept under "train_clip")."""
    return dict(
        zero_shot_top1=results.get("zero_shot_top1"),
        caption_r1=results.get("image_to_text_R@1"),
        train_clip=results,
    )


def train_clip_run(spec: dict) -> dict:
    """One train_clip.py run (its DataLoader workers in this process group: a timeout kills them too)."""
    t0 = time.perf_counter()
    run_dir = run_dir_of(spec)
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = train_clip_command(spec, run_dir)
    with open(run_dir / "stdout.txt", "w") as out:
        returncode = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    train, evals = read_train_log(run_dir / "train_log.jsonl")
    record = dict(
        spec=spec, train=train, evals=evals, grad_stats=[], steps=spec["steps"], command=" ".join(cmd)
    )
    results = run_dir / "all_results.json"
    if returncode == 0 and results.exists():
        record.update(status="ok", results=train_clip_results(json.loads(results.read_text())))
    else:
        record.update(status="failed", output_tail=(run_dir / "stdout.txt").read_text().splitlines()[-30:])
    record["train_s"] = record["wall_s"] = time.perf_counter() - t0
    return record


def from_train_clip_harness(run: dict, env: dict) -> dict:
    """A run record of the former train_clip-only harness (no "spec") in this harness's form, for --merge.

    Its runs before 2026-11-23 (no "data_layout") drew batches that depended on --num_workers: the worker
    count joins the pairing key there."""
    words = run.get("command", "").split()
    flag = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}  # the last one wins
    layout = run.get("data_layout") or f"strided-{flag.get('--num_workers')}"
    spec = dict(
        protocol="train_clip", task="default", variant=run["variant"], seed=run["seed"], data_order=layout,
        name=f"train_clip_{run['variant']}_seed{run['seed']}", arch=Path(flag.get("--model_config", "?")).name,
        batch_size=int(flag.get("--batch_size", env.get("batch_size", 0))), lr=float(flag.get("--lr", 0)),
        warmup=int(flag.get("--warmup_steps", 0)), eval_samples=int(flag.get("--max_eval_samples", 0)),
        steps=int(flag.get("--max_train_steps", env.get("steps", 0))), mixed=flag.get("--mixed_precision"),
        num_workers=int(flag.get("--num_workers", 0)),
    )  # fmt: skip
    results = run.get("results")
    return dict(
        run, spec=spec, steps=spec["steps"], grad_stats=[], train_s=run.get("wall_s"),
        results=train_clip_results(results) if results else None,
    )  # fmt: skip


def tiny_clip_config(config: Path, directory: Path) -> Path:
    """A CLIP config JSON shrunk to CPU-test size (train_clip smoke runs)."""
    data = json.loads(config.read_text())
    tower = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    data["text_config"].update(tower, vocab_size=64, projection_dim=32)
    data["vision_config"].update(tower, image_size=32, patch_size=8, projection_dim=32)
    data["projection_dim"] = 32
    path = directory / "tiny_clip.json"
    path.write_text(json.dumps(data))
    return path
