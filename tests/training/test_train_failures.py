"""examples/train_clip.py when things go wrong: a diverged run, NaN weights, a kill -9 mid-run, and what every rank
of a 2-process run agrees on (the checkpoint to resume, the collective timeout)."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from helpers import load_script
from train_helpers import (
    REPO,
    SCRIPT,
    clean_env,
    launch,
    read_results,
    run_in_process,
    write_tiny_model_config,
)

from hf_switchback.training.checkpoints import checkpoint_dirs
from hf_switchback.training.guard import UNBOUNDED_CEILING


def run_script(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """One process, no launcher (the quickest start); returns whatever the exit code."""
    cmd = [sys.executable, SCRIPT, *args]
    return subprocess.run(cmd, env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def tiny(tmp_path):
    config = write_tiny_model_config(str(tmp_path / "config.json"))
    return ["--model_config", config, "--batch_size", "8", "--num_workers", "0", "--eval_steps", "0",
            "--max_eval_samples", "16", "--synthetic_train_samples", "160"]  # fmt: skip


@pytest.mark.slow
def test_a_diverged_run_stops_with_an_error_and_keeps_the_previous_model(tmp_path, tiny):
    out = tmp_path / "run"
    good = run_script([*tiny, "--max_train_steps", "2", "--output_dir", str(out)])
    assert good.returncode == 0, good.stderr[-3000:]
    assert read_results(out)["status"] == "completed" and read_results(out)["nonfinite_skipped_steps"] == 0
    model = sha256(out / "model.safetensors")

    # lr 1e9: step 1 is finite, every later loss NaN. Before the guard: 46/46 NaN tensors saved, exit 0.
    again = [*tiny, "--output_dir", str(out), "--overwrite_output_dir", "--checkpointing_steps", "1"]
    diverged = run_script([*again, "--max_train_steps", "20", "--lr", "1e9", "--max_nonfinite_steps", "3"])
    assert diverged.returncode == 1
    assert "training failed: step 2: 3 consecutive steps with a non-finite loss" in diverged.stderr
    assert read_results(out)["status"] == "failed" and "step 2" in read_results(out)["error"]
    assert sha256(out / "model.safetensors") == model  # the good model is still there
    assert sorted(os.listdir(out / "checkpoints")) == ["step_1"]  # only the finite step was saved

    # --max_nonfinite_steps 0 is no license to loop forever: a skipped step leaves the weights as they were
    unbounded = run_script([*again, "--max_train_steps", "20", "--lr", "1e9", "--max_nonfinite_steps", "0"])
    assert unbounded.returncode == 1
    assert f"step 2: {UNBOUNDED_CEILING} consecutive steps with a non-finite loss" in unbounded.stderr
    assert read_results(out)["status"] == "failed"
    assert sha256(out / "model.safetensors") == model

    # lr inf would make the first update non-finite: refused before anything runs (the guard that keeps
    # non-finite weights from being written is tested in test_guard.py)
    poisoned = run_script([*again, "--max_train_steps", "4", "--lr", "inf"])
    assert poisoned.returncode == 2 and "--lr must be a number > 0" in poisoned.stderr
    assert sha256(out / "model.safetensors") == model


def test_an_output_dir_holding_a_run_is_refused_by_the_script(tmp_path, tiny):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_log.jsonl").write_text('{"step": 1}\n')
    proc = run_script([*tiny, "--max_train_steps", "1", "--output_dir", str(out)])
    assert proc.returncode == 2 and "holds a previous run (train_log.jsonl)" in proc.stderr


def test_resume_keeps_the_skip_count_checks_the_quantization_and_sets_newer_checkpoints_aside(
    tmp_path, tiny, monkeypatch, capsys
):
    """In process: a 4-step run with a NaN loss at the second step attempt and a checkpoint every step, then
    resumed from step_2 (a rollback). The skip survives the resume; another quantization or optimizer is refused
    before anything moves; the abandoned step_3, step_4 go aside, so `latest` continues the resumed run."""
    script = load_script(SCRIPT, "train_clip_failures")
    real_backward, calls = script.contrastive_backward, []

    def nan_at_second_call(*args):
        calls.append(1)
        loss = real_backward(*args)
        return loss * float("nan") if len(calls) == 2 else loss

    out = tmp_path / "run"
    run = [*tiny, "--max_train_steps", "4", "--output_dir", str(out)]
    monkeypatch.setattr(script, "contrastive_backward", nan_at_second_call)
    first = run_in_process(script, [*run, "--checkpointing_steps", "1", "--checkpoints_total_limit", "4"])
    assert (first["nonfinite_skipped_steps"], first["last_nonfinite_step"], first["train_steps"]) == (1, 2, 4)
    monkeypatch.setattr(script, "contrastive_backward", real_backward)
    step_2 = str(out / "checkpoints" / "step_2")

    changed = ["--weight_scaling", "row", "--optimizer", "stableadamw"]
    with pytest.raises(ValueError) as exc:
        run_in_process(script, [*run, "--resume_from_checkpoint", step_2, *changed])
    assert "switchback.weight_scaling: 'tensor' in the checkpoint, 'row' now" in str(exc.value)
    assert "optimizer.name: 'adamw' in the checkpoint, 'stableadamw' now" in str(exc.value)
    assert [os.path.basename(p) for p in checkpoint_dirs(str(out))] == [
        "step_1",
        "step_2",
        "step_3",
        "step_4",
    ]

    # a structure change is refused before loading, and a load that fails moves nothing: `latest` is still step_4
    with pytest.raises(ValueError, match=r"other trained parameters .*structure.lock_image: False in the"):
        run_in_process(
            script, [*run, "--resume_from_checkpoint", step_2, "--lock_image", "--allow_resume_mismatch"]
        )
    broken = tmp_path / "broken_step_2"
    shutil.copytree(step_2, broken)
    size = (broken / "optimizer.bin").stat().st_size
    (broken / "optimizer.bin").write_bytes(b"\0" * size)  # same size: only loading finds it out
    with pytest.raises(Exception, match=r"(?i)pickle|load|zip"):
        run_in_process(script, [*run, "--resume_from_checkpoint", str(broken)])
    assert [os.path.basename(p) for p in checkpoint_dirs(str(out))] == [
        "step_1",
        "step_2",
        "step_3",
        "step_4",
    ]
    assert not any(name.startswith("abandoned") for name in os.listdir(out / "checkpoints"))

    resumed = run_in_process(script, [*run, "--resume_from_checkpoint", step_2, "--checkpointing_steps", "0"])
    assert (resumed["nonfinite_skipped_steps"], resumed["last_nonfinite_step"]) == (
        1,
        2,
    )  # from step_2's state
    assert resumed["train_steps"] == 4
    assert [os.path.basename(p) for p in checkpoint_dirs(str(out))] == ["step_1", "step_2"]
    assert sorted(os.listdir(out / "checkpoints" / "abandoned_after_step_2")) == ["step_3", "step_4"]

    # `latest` with no checkpoint: a used output_dir is refused, an overwrite (or an empty dir) starts fresh
    other = tmp_path / "other"
    other.mkdir()
    (other / "all_results.json").write_text("{}")
    (other / "spike_monitor.png").write_text("stale")
    fresh = [
        *tiny,
        "--max_train_steps",
        "1",
        "--output_dir",
        str(other),
        "--resume_from_checkpoint",
        "latest",
    ]
    with pytest.raises(SystemExit):
        run_in_process(script, fresh)
    assert "holds no complete checkpoint" in capsys.readouterr().err
    assert run_in_process(script, [*fresh, "--overwrite_output_dir"])["train_steps"] == 1
    assert f"no checkpoint found in {other}/checkpoints: starting from scratch" in capsys.readouterr().out
    assert not (other / "spike_monitor.png").exists()  # the previous run's files went, as for a fresh run


WORKER = """
import os, sys, types
import torch
from accelerate import Accelerator
from torch.distributed import distributed_c10d as c10d
from hf_switchback.training.checkpoints import resolve_checkpoint
from hf_switchback.training.runtime import process_group_kwargs

accelerator = Accelerator(cpu=True, kwargs_handlers=[process_group_kwargs(10)])
# read the timeout, then drop the backend: a gloo backend still referenced when the interpreter exits is torn
# down after the process group, and its worker threads abort the process ("terminate called without an
# active exception")
timeout = c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
# rank 1 looks at a lagging copy of the output_dir: it must still resume from what the main process picked
output_dir = sys.argv[1] if accelerator.is_main_process else sys.argv[2]
args = types.SimpleNamespace(output_dir=output_dir, resume_from_checkpoint="latest")
print(f"rank {accelerator.process_index}: {resolve_checkpoint(args, accelerator)} timeout {timeout}")
accelerator.end_training()
"""


@pytest.mark.slow
def test_every_rank_resumes_from_the_checkpoint_the_main_process_picked_and_the_timeout_applies(tmp_path):
    for folder, steps in (("main", (2, 4)), ("lagging", (2,))):
        for step in steps:
            path = tmp_path / folder / "checkpoints" / f"step_{step}"
            path.mkdir(parents=True)
            (path / "checkpoint.json").write_text(json.dumps({"step": step}))
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    proc = launch([str(worker), str(tmp_path / "main"), str(tmp_path / "lagging")], num_processes=2)
    expected = tmp_path / "main" / "checkpoints" / "step_4"
    for rank in (0, 1):
        # 10 min: accelerate drops a timeout equal to its NCCL default unless told otherwise; gloo's is 30
        assert f"rank {rank}: {expected} timeout 0:10:00" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_kill_9_of_a_rank_mid_run_resumes_to_the_same_losses(tmp_path, capsys):
    """One repetition of tests/training/kill_resume.py (the full check runs 20): 2 ranks, a checkpoint every step,
    one rank SIGKILLed at a random moment, resumed with 'latest': every logged loss equals the reference."""
    kill_resume = load_script("tests/training/kill_resume.py")
    assert (
        kill_resume.main(["--repeats", "1", "--steps", "8", "--seed", "5", "--workdir", str(tmp_path)]) == 0
    )
    # the kill landed mid-run (a run that finished before it would prove nothing)
    assert "summary: 1/1 resumed to the reference losses (1 killed mid-run" in capsys.readouterr().out


def test_a_full_disk_during_a_checkpoint_fails_the_run_naming_the_path(tmp_path, tiny, monkeypatch, capsys):
    """ENOSPC inside accelerate's save: the run ends with one line naming the path and status failed in
    all_results.json, instead of torch's "unexpected pos" and no results."""
    import errno

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    script = load_script(SCRIPT, "train_clip_disk_full")

    def full(self, folder, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(folder, "optimizer.bin"))

    monkeypatch.setattr(Accelerator, "save_state", full)
    out = tmp_path / "run"
    argv = [*tiny, "--max_train_steps", "2", "--checkpointing_steps", "1", "--output_dir", str(out)]
    monkeypatch.setattr(sys, "argv", ["train_clip.py", *argv])
    AcceleratorState._reset_state(True)
    try:
        with pytest.raises(SystemExit) as exc:
            script.main()
    finally:
        AcceleratorState._reset_state(True)
    checkpoints = out / "checkpoints"
    written = checkpoints / ".step_1.tmp" / "optimizer.bin"
    expected = (
        f"training failed: [Errno 28] no space left on device while writing {written}: free space and resume"
    )
    assert str(exc.value) == expected
    assert read_results(out)["status"] == "failed" and "no space left" in read_results(out)["error"]
    assert os.listdir(checkpoints) == []  # the partial save is removed


ROTATION_KILLER = """
import os, runpy, shutil, signal, sys
real_rmtree = shutil.rmtree

def rmtree(path, *args, **kwargs):  # kill -9 half-way through deleting an old checkpoint
    if os.path.exists(os.path.join(path, "optimizer.bin")):
        os.remove(os.path.join(path, "optimizer.bin"))
        os.kill(os.getpid(), signal.SIGKILL)
    return real_rmtree(path, *args, **kwargs)

shutil.rmtree = rmtree
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

LOCK_HOLDER = """
import sys, time
from hf_switchback.training.lifecycle import OutputDirLock
lock = OutputDirLock(sys.argv[1])  # held while referenced: the open file is the lock
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def final_weights(output_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(output_dir, "model.safetensors"))


@pytest.mark.slow
def test_a_kill_during_rotation_and_a_second_writer_lose_nothing(tmp_path, tiny):
    """Real processes: kill -9 while rotation deletes step_1, then a second process holding the output dir
    (as a training child left by a killed launcher would): the resume is refused naming it, and moves nothing.
    Once that process is gone (its lock dies with it), `latest` resumes step_2 and ends with the weights of an
    uninterrupted run."""
    import torch

    run = [*tiny, "--max_train_steps", "4", "--checkpointing_steps", "1", "--checkpoints_total_limit", "1"]
    reference = tmp_path / "reference"
    done = run_script([*run, "--output_dir", str(reference)])
    assert done.returncode == 0, done.stderr[-3000:]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(reference / "model.safetensors").st_mode & 0o777 == 0o666 & ~umask  # not safetensors' 0600

    out = tmp_path / "run"
    killer = tmp_path / "killer.py"
    killer.write_text(ROTATION_KILLER)
    cmd = [sys.executable, str(killer), SCRIPT, *run, "--output_dir", str(out)]
    killed = subprocess.run(cmd, env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == [".step_1.old.tmp", "step_2"]
    assert checkpoint_dirs(str(out)) == [str(out / "checkpoints" / "step_2")]

    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(out)],
        env=clean_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        resume = [*run, "--output_dir", str(out), "--resume_from_checkpoint", "latest"]
        refused = run_script(resume)
        assert refused.returncode == 1
        assert f"is being written by another training process (pid {holder.pid} on host" in refused.stderr
        assert sorted(os.listdir(out / "checkpoints")) == [".step_1.old.tmp", "step_2"]
    finally:
        holder.kill()
        holder.wait()

    resumed = run_script(resume)  # the lock of the dead holder is free: no stale-lock cleanup needed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / 'step_2'}" in resumed.stdout
    expected, got = final_weights(reference), final_weights(out)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)  # bit-identical to the uninterrupted run
    assert sorted(os.listdir(out / "checkpoints")) == ["step_4"]


def _logged_step(output_dir) -> int:
    """The highest step in train_log.jsonl (0: none yet); a line cut by a kill is ignored."""
    best = 0
    try:
        with open(os.path.join(output_dir, "train_log.jsonl")) as f:
            for line in f:
                try:
                    best = max(best, int(json.loads(line)["step"]))
                except (ValueError, KeyError, TypeError):
                    continue
    except FileNotFoundError:
        pass
    return best


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HF_SWITCHBACK_SOAK") != "1", reason="soak test: set HF_SWITCHBACK_SOAK=1")
def test_soak_twenty_kill_9_of_the_training_process_end_with_the_uninterrupted_weights(tmp_path, tiny):
    """kill -9 of the training process itself (no launcher in between) 20 times over one run, each at a random
    moment of a step or a checkpoint save, relaunched with `latest` each time: the final weights equal an
    uninterrupted run's bit for bit. Minutes on 2 cores, so only on request (HF_SWITCHBACK_SOAK=1)."""
    import random
    import time

    import torch

    steps, kills = 100, 20
    run = [*tiny, "--max_train_steps", str(steps), "--checkpointing_steps", "1", "--logging_steps", "1"]
    reference = tmp_path / "reference"
    began = time.monotonic()
    done = run_script([*run, "--output_dir", str(reference)])
    assert done.returncode == 0, done.stderr[-3000:]
    step_time = (time.monotonic() - began) / steps  # generous: includes the start-up

    out, rng, killed = tmp_path / "run", random.Random(0), 0
    while killed < kills:
        resume = ["--resume_from_checkpoint", "latest"] if out.exists() else []
        if resume and not checkpoint_dirs(str(out)):
            resume.append("--overwrite_output_dir")  # killed before the first checkpoint was complete
        # the log may still hold lines past the last checkpoint (the killed launch logged them before saving):
        # only a step beyond them is this launch's; the kills are spread over the run
        target = max(_logged_step(out) + 1, (killed + 1) * steps // (kills + 1))
        cmd = [sys.executable, SCRIPT, *run, "--output_dir", str(out), *resume]
        proc = subprocess.Popen(
            cmd, env=clean_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        while proc.poll() is None and _logged_step(out) < target:
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 2 * step_time))
        if proc.poll() is not None:
            break  # finished before the kill
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed += 1
    final = run_script([*run, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert final.returncode == 0, final.stderr[-3000:]
    assert killed == kills, f"only {killed} kills landed before the run ended"
    expected, got = final_weights(reference), final_weights(out)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert read_results(out)["train_steps"] == steps
