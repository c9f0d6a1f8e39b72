"""Checkpoints of examples/train_clip.py: accelerate's save_state (model, optimizer, scheduler, RNG of every rank)
plus our data position, and the run's train_log.jsonl.

Layout: <output_dir>/checkpoints/step_<N>/ holds what `accelerator.save_state` writes and one
train_state_rank<R>.json per rank ({"step", "epoch", "batch_in_epoch", "loss_sum", "num_skipped"}).
"""

from __future__ import annotations

import json
import os
import re
import shutil

CHECKPOINT_PREFIX = "step_"


def checkpoint_dirs(output_dir: str) -> list[str]:
    """The step_<N> checkpoint directories under <output_dir>/checkpoints, oldest (smallest N) first."""
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", n)]
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: int(n[len(CHECKPOINT_PREFIX) :]))]


def resolve_checkpoint(args) -> str | None:
    """The directory --resume_from_checkpoint names ('latest': the newest in output_dir), or None."""
    if not args.resume_from_checkpoint:
        return None
    if args.resume_from_checkpoint == "latest":
        found = checkpoint_dirs(args.output_dir)
        return found[-1] if found else None
    return args.resume_from_checkpoint


def save_checkpoint(accelerator, args, state: dict) -> None:
    """save_state + every rank's train state; keeps the newest --checkpoints_total_limit checkpoints."""
    path = os.path.join(args.output_dir, "checkpoints", f"{CHECKPOINT_PREFIX}{state['step']}")
    accelerator.save_state(path)
    # Every rank has its own data position (streams are per rank), so every rank writes its own file.
    with open(os.path.join(path, f"train_state_rank{accelerator.process_index}.json"), "w") as f:
        json.dump(state, f)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and args.checkpoints_total_limit:
        for old in checkpoint_dirs(args.output_dir)[: -args.checkpoints_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_train_state(path: str, rank: int) -> dict:
    file = os.path.join(path, f"train_state_rank{rank}.json")
    if not os.path.exists(file):
        raise FileNotFoundError(
            f"{file} is missing: was the checkpoint written with this number of processes?"
        )
    with open(file) as f:
        return json.load(f)


def append_log(accelerator, path: str, record: dict) -> None:
    """One JSON line per logging step / eval in <output_dir>/train_log.jsonl (main process; appends on resume)."""
    if accelerator.is_main_process:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def reset_log(path: str, keep_until: int) -> None:
    """Drop the lines of train_log.jsonl after step `keep_until` (a resumed run writes them again)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= keep_until]
    with open(path, "w") as f:
        f.writelines(kept)
