"""What a train_clip.py run prints and records: lines above the progress bar (never glued onto it), where the
outputs went, and all_results.json naming the mixed precision and SwitchBack config that ran."""

import dataclasses
import io
import json
import logging
import os
import sys

import pytest
from train_helpers import load_script, run_in_process, write_tiny_model_config

from hf_switchback import KernelOptions, SwitchBackConfig
from hf_switchback.kernels.options import FP8_GEMM_ENV
from hf_switchback.training.lifecycle import TqdmLoggingHandler


@pytest.fixture(scope="module")
def script():
    return load_script("train_clip_console")


def tiny_run(tmp_path, *flags) -> list[str]:
    config = write_tiny_model_config(str(tmp_path / "config.json"))
    return ["--model_config", config, "--max_train_steps", "2", "--batch_size", "8", "--num_workers", "0",
            "--synthetic_train_samples", "32", "--max_eval_samples", "16", "--output_dir", str(tmp_path / "run"),
            *flags]  # fmt: skip


def terminal_lines(text: str) -> list[str]:
    """What a terminal shows: each line as left by its last carriage return (the bar redraws with \\r)."""
    return [line.split("\r")[-1] for line in text.split("\n")]


class Terminal(io.StringIO):
    """stdout and stderr into one stream that says it is a terminal (the progress bar is drawn there)."""

    def isatty(self) -> bool:
        return True


def test_eval_and_loss_lines_stand_on_their_own_lines(script, tmp_path, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    run_in_process(script, tiny_run(tmp_path, "--log_losses", "--logging_steps", "1", "--eval_steps", "1"))
    text = terminal.getvalue()
    assert "it/s]" in text or "s/it]" in text  # the progress bar was drawn to the same stream
    shown = terminal_lines(text)
    out = os.path.abspath(tmp_path / "run")
    for marker in ("step 1 loss ", "step 2 loss ", "step 1: ", "step 2: "):
        lines = [line for line in text.split("\n") if marker in line]
        assert lines, marker
        assert all(line.split("\r")[-1].startswith(marker) for line in lines), lines
    assert f"output directory: {out}" in shown
    assert any(line.startswith("saved the model") and line.endswith(f"in {out}") for line in shown), shown


def test_log_file_gets_plain_lines_a_readable_config_and_a_short_summary(script, tmp_path, monkeypatch):
    """stderr redirected to a file: no carriage-return redraws, a progress line every --logging_steps, the
    SwitchBack config one field a line, and a one-line summary instead of the results JSON."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    run_in_process(script, tiny_run(tmp_path, "--max_train_steps", "5", "--logging_steps", "2"))
    stdout, stderr = out.getvalue(), err.getvalue()
    assert "\r" not in stderr and "\r" not in stdout
    progress = [line.split(" elapsed ")[0] for line in stderr.splitlines() if line.startswith("step ")]
    assert [p.split(" loss=")[0] for p in progress] == ["step 2/5 (40%)", "step 4/5 (80%)", "step 5/5 (100%)"]
    assert "\n  weight_scaling    tensor\n" in stdout and "SwitchBackConfig(" not in stdout
    summary = [line for line in stdout.splitlines() if line.startswith("completed: 5 steps, zero_shot_top1 ")]
    assert len(summary) == 1 and '"status"' not in stdout
    assert json.loads((tmp_path / "run" / "all_results.json").read_text())["train_steps"] == 5


def test_log_records_go_above_the_progress_bar(monkeypatch):
    from tqdm.auto import tqdm

    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    logger = logging.getLogger("test_console")
    handler = TqdmLoggingHandler()
    logger.addHandler(handler)
    try:
        with tqdm(total=2) as bar:  # file: sys.stderr, the terminal
            bar.update(1)
            logger.warning("spike at step 1")
            bar.update(1)
    finally:
        logger.removeHandler(handler)
    assert "spike at step 1" in terminal_lines(terminal.getvalue())


def test_results_record_mixed_precision_and_the_switchback_config(script, tmp_path, monkeypatch):
    monkeypatch.setenv(FP8_GEMM_ENV, "triton")  # a non-default kernel option: the results must name it
    flags = ["--eval_steps", "0", "--mixed_precision", "bf16", "--weight_scaling", "row", "--min_tokens", "0"]
    results = run_in_process(script, tiny_run(tmp_path, *flags))
    with open(tmp_path / "run" / "all_results.json") as f:
        assert json.load(f) == results
    assert results["mixed_precision"] == "bf16"
    loaded = SwitchBackConfig.from_dict(results["switchback"])
    assert loaded == SwitchBackConfig(weight_scaling="row", min_tokens=0)
    # the kernel options that ran (config.json leaves them out; the results keep them)
    assert results["switchback"]["kernel_options"] == dataclasses.asdict(KernelOptions(fp8_gemm="triton"))
    assert loaded.kernel_options.fp8_gemm == "triton"

    (tmp_path / "off").mkdir()
    off = run_in_process(script, tiny_run(tmp_path / "off", "--eval_steps", "0", "--switchback", "off"))
    assert off["switchback"] is None and off["mixed_precision"] == "no"
