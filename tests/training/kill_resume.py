"""kill -9 at a random moment of a 2-rank CPU run (gloo), then resume until done: does every resumed run end with
the same losses as the uninterrupted one?

Each repetition launches examples/train_clip.py on 2 CPU processes (accelerate_configs/cpu.yaml) with a tiny
CLIP and a checkpoint after every step, SIGKILLs one rank (or the launcher and every rank at once) at a
random time after step 1 (see `trial`), then relaunches with `--resume_from_checkpoint latest` until a launch exits
0 (with `--overwrite_output_dir` too when the kill came before the first complete checkpoint: `latest` alone refuses
an output_dir holding a run but no checkpoint). The run passes when train_log.jsonl holds the reference's loss at
every step (relative 1e-6) and all_results.json the same train_loss. Linux only (reads /proc to find the ranks).

    python tests/training/kill_resume.py --repeats 20            # the full check (~20-40 min on 2 cores)
    python tests/training/kill_resume.py --repeats 1 --steps 8 --seed 5   # what CI runs (tests/training/test_train_failures.py)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "train_clip.py")
CPU_CONFIG = os.path.join(REPO, "accelerate_configs", "cpu.yaml")
TINY = dict(hidden=32, layers=1, image_size=32, vocab=64)


def tiny_model_config(path: str) -> str:
    """A 1-layer CLIP config (the synthetic word tokenizer's vocabulary fits in 64 ids)."""
    from transformers import CLIPConfig

    tower = dict(hidden_size=TINY["hidden"], intermediate_size=2 * TINY["hidden"], num_attention_heads=2)
    tower["num_hidden_layers"] = TINY["layers"]
    text = dict(tower, vocab_size=TINY["vocab"], max_position_embeddings=16, bos_token_id=2, eos_token_id=3)
    text["pad_token_id"] = 0
    vision = dict(tower, image_size=TINY["image_size"], patch_size=8)
    CLIPConfig(text_config=text, vision_config=vision, projection_dim=16).to_json_file(path)
    return path


def env() -> dict:
    keep = ("PATH", "PYTHONPATH", "HOME", "LANG", "TMPDIR", "USER")
    out = {k: os.environ[k] for k in keep if k in os.environ}
    src = os.path.join(REPO, "src")
    out["PYTHONPATH"] = src + (os.pathsep + out["PYTHONPATH"] if "PYTHONPATH" in out else "")
    out.update(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1"
    )
    return out


def command(
    config: str, output_dir: str, steps: int, port: int, resume: bool, overwrite: bool = False
) -> list[str]:
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_CONFIG]
    launcher += [
        "--num_processes",
        "2",
        "--main_process_port",
        str(port),
        "--num_cpu_threads_per_process",
        "1",
    ]
    args = [SCRIPT, "--model_config", config, "--max_train_steps", str(steps), "--batch_size", "8"]
    args += ["--synthetic_train_samples", "160", "--num_workers", "0", "--eval_steps", "0"]
    args += ["--max_eval_samples", "16", "--logging_steps", "1", "--checkpointing_steps", "1", "--lr", "1e-3"]
    args += ["--output_dir", output_dir] + (["--resume_from_checkpoint", "latest"] if resume else [])
    return launcher + args + ["--overwrite_output_dir"] * overwrite


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_pids(output_dir: str) -> list[int]:
    """PIDs of the training processes (not the launcher) of the run writing to `output_dir`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        text = b" ".join(argv)
        if (
            SCRIPT.encode() in text
            and output_dir.encode() in text
            and b"accelerate.commands.launch" not in text
        ):
            pids.append(int(entry))
    return pids


def launch(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def logged(output_dir: str) -> tuple[dict[int, float], float | None]:
    losses = {}
    with open(os.path.join(output_dir, "train_log.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if "loss" in record:
                losses[record["step"]] = record["loss"]
    with open(os.path.join(output_dir, "all_results.json")) as f:
        return losses, json.load(f).get("train_loss")


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def wait_for_step(proc: subprocess.Popen, output_dir: str, step: int, timeout: float = 600) -> float:
    """Block until train_log.jsonl has the line of `step` (or the run ended); returns the time then."""
    log, deadline = os.path.join(output_dir, "train_log.jsonl"), time.monotonic() + timeout
    needle = f'{{"step": {step}, '
    while proc.poll() is None and time.monotonic() < deadline:
        if os.path.exists(log):
            with open(log) as f:
                if any(line.startswith(needle) for line in f):
                    break
        time.sleep(0.02)
    return time.perf_counter()


def reference(config: str, workdir: str, steps: int) -> tuple[dict, float, float]:
    """The uninterrupted run: its losses, train_loss, and how long its steps 2..N took (the kill window)."""
    out = os.path.join(workdir, "reference")
    proc = start(command(config, out, steps, free_port(), resume=False))
    began = wait_for_step(proc, out, 1)
    window = wait_for_step(proc, out, steps) - began
    if proc.wait(timeout=600) != 0:
        raise RuntimeError("reference run failed: " + " ".join(command(config, out, steps, 0, resume=False)))
    losses, train_loss = logged(out)
    return losses, train_loss, window


def trial(config: str, workdir: str, steps: int, wall: float, rng: random.Random, index: int) -> dict:
    """One kill at a random moment after step 1, uniform over the reference's time for steps 2..N, so it lands
    among the steps and checkpoint saves (a run that finishes first counts as not killed). Then resumes until a
    launch finishes. Returns what happened."""
    out = os.path.join(workdir, f"trial_{index}")
    delay = rng.uniform(0, wall)
    proc = start(command(config, out, steps, free_port(), resume=False))
    wait_for_step(proc, out, 1)
    time.sleep(delay)
    victim, finished_first = None, proc.poll() is not None
    if not finished_first:
        ranks = sorted(rank_pids(out))
        target = rng.choice(["launcher", *range(len(ranks))])
        if target == "launcher" or not ranks:
            victim = (
                "all"  # torchrun puts each rank in its own process group: the launcher's and every rank's
            )
            for pid in [proc.pid, *ranks]:
                os.kill(pid, signal.SIGKILL)
        else:
            victim = f"rank {target}"
            os.kill(ranks[target], signal.SIGKILL)
    try:
        proc.wait(timeout=120)  # torchrun takes the surviving rank down
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in rank_pids(out):  # nothing of the killed run may write on
        os.kill(pid, signal.SIGKILL)
    checkpoints = os.path.join(out, "checkpoints")
    left = sorted(os.listdir(checkpoints)) if os.path.isdir(checkpoints) else []
    # killed before step_1 was complete: nothing to resume, and the killed run's log must go (the refusal says so)
    none_complete = not any(
        n.startswith("step_") and os.path.isfile(os.path.join(checkpoints, n, "checkpoint.json"))
        for n in left
    )
    relaunches = 0
    while True:
        relaunches += 1
        cmd = command(config, out, steps, free_port(), resume=True, overwrite=none_complete)
        done = launch(cmd, timeout=600)
        if done.returncode == 0 or relaunches >= 3:
            break
    result = {"delay_s": round(delay, 1), "killed": victim, "left": left, "relaunches": relaunches}
    if done.returncode != 0:
        return {**result, "ok": False, "error": (done.stdout + done.stderr)[-3000:]}
    resumed_from = [line for line in done.stdout.splitlines() if line.startswith("resuming from")]
    result["resumed_from"] = os.path.basename(resumed_from[0].split()[-1]) if resumed_from else None
    result["losses"], result["train_loss"] = logged(out)
    return result


def same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7)


def check(result: dict, ref_losses: dict, ref_train_loss: float) -> bool:
    if "losses" not in result:
        return False
    losses = result["losses"]
    return (
        sorted(losses) == sorted(ref_losses)
        and all(same(losses[s], ref_losses[s]) for s in ref_losses)
        and same(result["train_loss"], ref_train_loss)
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="Kill-and-resume repetitions.")
    parser.add_argument("--steps", type=int, default=20, help="Optimizer steps per run (a checkpoint each).")
    parser.add_argument("--seed", type=int, default=0, help="Seed for the kill times and victims.")
    parser.add_argument("--workdir", help="Where runs go (default: a temporary directory, removed).")
    parser.add_argument("--json", help="Write the per-repetition results here.")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kill_resume_") as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        config = tiny_model_config(os.path.join(workdir, "config.json"))
        ref_losses, ref_train_loss, wall = reference(config, workdir, args.steps)
        print(f"reference: steps 2-{args.steps} took {wall:.1f} s, final loss {ref_losses[args.steps]:.8f}")
        results = []
        for i in range(args.repeats):
            result = trial(config, workdir, args.steps, wall, rng, i)
            result["ok"] = result.get("ok", True) and check(result, ref_losses, ref_train_loss)
            results.append(result)
            final = result.get("losses", {}).get(args.steps)
            print(
                f"[{i + 1}/{args.repeats}] kill {result['delay_s']} s after step 1 ({result['killed'] or 'run had ended'}),"
                f" checkpoints left {result['left']}, resumed from {result.get('resumed_from')}, "
                f"final loss {final}, {'same' if result['ok'] else 'DIFFERENT'}",
                flush=True,
            )
            if not result["ok"] and "error" in result:
                print(result["error"])
    killed = [r for r in results if r["killed"]]
    passed = sum(r["ok"] for r in results)
    print(
        f"summary: {passed}/{len(results)} resumed to the reference losses ({len(killed)} killed mid-run, "
        f"{sum(r['killed'] == 'all' for r in killed)} of them launcher and all ranks at once)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reference_losses": ref_losses, "results": results}, f, indent=2)
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
