"""examples/train_clip.py end to end: --help, argument checks, the default run learning, exact resume."""

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
from train_helpers import (
    REPO,
    SCRIPT,
    clean_env,
    launch,
    logged_losses,
    read_results,
    write_tiny_model_config,
)

from hf_switchback.training import cli, runtime


def test_help_lists_every_flag_with_help():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    parser = cli.build_parser()
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in proc.stdout, flag
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"
    for group in ("model", "SwitchBack", "data", "optimization", "speed and memory", "checkpoints"):
        assert group in proc.stdout
    for flag in ("--accum_freq", "--resume_from_checkpoint", "--patch_dropout", "--report_to", "--optimizer"):
        assert flag in proc.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lock_image", "--lock_text"], "nothing to train"),
        (["--train_file", "a.csv", "--train_shards", "s/"], "one training data source"),
        (["--train_shards", "s/"], "--max_train_steps"),
        (["--model_name_or_path", "m", "--model_config", "c.json"], "exclusive"),
        (["--switchback", "off", "--weight_scaling", "row"], "--switchback off"),
        (["--accum_freq", "0"], "--accum_freq must be >= 1"),
        (["--patch_dropout", "1.0"], "--patch_dropout"),
        (["--push_to_hub"], "--hub_model_id"),
        (["--max_eval_samples", "1000"], "distinct samples"),
        (["--resume_from_checkpoint", "/no/such/dir"], "is not a directory"),
        (["--precision", "int4"], "invalid choice"),
        (["--zeroshot_templates", "a photo"], "needs a {}"),
        (["--model_name_or_path", "m", "--tokenizer_name_or_path", "t"], "brings its own tokenizer"),
        (["--compile_mode", "reduce-overhead"], "--compile_mode needs --torch_compile"),
        (
            ["--torch_compile", "--compile_mode", "reduce-overhead", "--accum_freq", "2"],
            "needs --accum_freq 1",
        ),
    ],
)
def test_invalid_combinations_fail_at_start(argv, message, capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit) as exc:
        cli.check_args(parser, parser.parse_args(argv))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_compile_mode_reaches_accelerate_and_picks_the_gemm(monkeypatch):
    """--compile_mode becomes accelerate's dynamo mode; CUDA graphs on Hopper switch on the TMA GEMM (and only
    there: the portable GEMM stays elsewhere, and without SwitchBack nothing is touched)."""
    from hf_switchback.kernels import matmul

    parser = cli.build_parser()
    assert runtime.dynamo_plugin(parser.parse_args([])) is None
    plugin = runtime.dynamo_plugin(parser.parse_args(["--torch_compile"]))
    assert plugin.backend.value.lower() == "inductor" and plugin.mode == "default"
    monkeypatch.setattr(matmul, "USE_TMA", False)
    graphs = ["--torch_compile", "--compile_mode", "reduce-overhead"]
    monkeypatch.setattr(runtime, "tma_gemm_available", lambda: False)
    assert runtime.dynamo_plugin(parser.parse_args(graphs)).mode == "reduce-overhead"
    assert matmul.USE_TMA is False
    monkeypatch.setattr(runtime, "tma_gemm_available", lambda: True)
    runtime.dynamo_plugin(parser.parse_args([*graphs, "--switchback", "off"]))
    assert matmul.USE_TMA is False
    runtime.dynamo_plugin(parser.parse_args(graphs))
    assert matmul.USE_TMA is True


def test_invalid_combination_exits_before_loading_anything():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--lock_image", "--lock_text"],
        env=clean_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "nothing to train" in proc.stderr


@pytest.mark.slow
def test_default_run_learns_far_above_chance(tmp_path):
    """The embedded default, shortened: zero-shot (32 classes, chance 3.1%) and retrieval (chance 1/256)."""
    out = tmp_path / "run"
    # ~2.5 s a step with one thread on a 2-core CI machine: the timeout only catches a hang
    launch([SCRIPT, "--max_train_steps", "150", "--eval_steps", "0", "--output_dir", str(out)], timeout=900)
    results = read_results(out)
    assert results["zero_shot_top1"] > 0.2, results
    assert results["image_to_text_R@1"] > 0.05 and results["text_to_image_R@1"] > 0.05, results
    assert results["train_samples_per_second"] > 0 and results["train_loss"] > 0
    # the final model is a plain CLIP checkpoint in safetensors, with its processor
    assert (out / "model.safetensors").exists()
    from transformers import CLIPModel, CLIPProcessor

    CLIPModel.from_pretrained(out)
    CLIPProcessor.from_pretrained(out)


@pytest.mark.slow
def test_resume_continues_exactly_two_ranks_streaming(tmp_path):
    """2 ranks x 2 workers on webdataset shards, accum_freq 2, patch dropout: losses after resuming from the
    step-4 checkpoint (mid-way through the second epoch) equal those of the uninterrupted run."""
    shards = tmp_path / "shards"
    subprocess.run(
        [sys.executable, "-m", "hf_switchback.training.synthetic", "--output_dir", str(shards),
         "--num_samples", "96", "--samples_per_shard", "24", "--image_size", "32"],
        env=clean_env(), check=True, cwd=REPO, capture_output=True,
    )  # fmt: skip
    with tarfile.open(shards / "shard-000001.tar", "a") as tar:  # one unreadable sample, met once per epoch
        info = tarfile.TarInfo("corrupt.png")
        info.size = 7
        tar.addfile(info, io.BytesIO(b"garbage"))
    config = write_tiny_model_config(str(tmp_path / "config.json"))
    common = [SCRIPT, "--model_config", config, "--train_shards", str(shards), "--max_train_steps", "6",
              "--batch_size", "8", "--accum_freq", "2", "--num_workers", "2", "--patch_dropout", "0.25",
              "--logging_steps", "1", "--log_losses", "--eval_steps", "0", "--max_eval_samples", "16",
              "--checkpointing_steps", "2", "--lr", "1e-3"]  # fmt: skip
    full = launch([*common, "--output_dir", str(tmp_path / "full")], num_processes=2)
    full_losses = logged_losses(full.stdout)
    assert sorted(full_losses) == [1, 2, 3, 4, 5, 6]
    # retention (checkpoints_total_limit 2): step_2 was deleted
    assert sorted(os.listdir(tmp_path / "full" / "checkpoints")) == ["step_4", "step_6"]
    # a rank holds 48 samples = 6 batches of 8 = 3 steps: step 4 is one step into the second epoch
    checkpoint = tmp_path / "full" / "checkpoints" / "step_4"
    state = json.loads((checkpoint / "train_state_rank1.json").read_text())
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (4, 1, 2)

    # "stopped after 4 steps": a run directory whose newest checkpoint is step 4, resumed with "latest"
    shutil.copytree(checkpoint, tmp_path / "resumed" / "checkpoints" / "step_4")
    resumed = launch(
        [*common, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", "latest"],
        num_processes=2,
    )
    assert "resuming from" in resumed.stdout and "step_4" in resumed.stdout
    resumed_losses = logged_losses(resumed.stdout)
    assert sorted(resumed_losses) == [5, 6]
    for step in (5, 6):
        assert resumed_losses[step] == pytest.approx(full_losses[step], rel=1e-6, abs=1e-6), step
    # different data would give different losses: the comparison above can fail
    assert len({round(v, 6) for v in full_losses.values()}) == 6
    # 2 epochs -> the corrupt sample was skipped twice, counted across ranks and across the resume
    assert read_results(tmp_path / "full")["train_skipped_samples"] == 2
    assert read_results(tmp_path / "resumed")["train_skipped_samples"] == 2
    assert read_results(tmp_path / "resumed")["train_steps"] == 6


@pytest.mark.slow
def test_speed_and_memory_flags_together(tmp_path):
    """bf16 autocast, grad checkpointing, patch dropout, a locked text tower, row-wise memory-efficient
    SwitchBack, StableAdamW, accum_freq 2 and TensorBoard in one short run; the locked tower must not move."""
    import torch
    from safetensors.torch import load_file
    from transformers import CLIPConfig, CLIPModel

    config = write_tiny_model_config(str(tmp_path / "config.json"))
    out = tmp_path / "run"
    launch(
        [SCRIPT, "--model_config", config, "--max_train_steps", "3", "--batch_size", "8", "--accum_freq", "2",
         "--mixed_precision", "bf16", "--grad_checkpointing", "--patch_dropout", "0.5", "--lock_text",
         "--weight_scaling", "row", "--memory_efficient", "--optimizer", "stableadamw", "--report_to",
         "tensorboard", "--eval_steps", "2", "--max_eval_samples", "32", "--output_dir", str(out)],
    )  # fmt: skip
    results = read_results(out)
    assert results["train_steps"] == 3 and 0 <= results["zero_shot_top1"] <= 1
    assert any("events.out.tfevents" in name for _, _, files in os.walk(out) for name in files)
    torch.manual_seed(0)  # the script's --seed 0: the same initial weights
    initial = CLIPModel(CLIPConfig.from_json_file(config)).state_dict()
    trained = load_file(out / "model.safetensors")
    assert torch.equal(
        trained["text_model.encoder.layers.0.mlp.fc1.weight"],
        initial["text_model.encoder.layers.0.mlp.fc1.weight"],
    )
    assert not torch.equal(
        trained["vision_model.encoder.layers.0.mlp.fc1.weight"],
        initial["vision_model.encoder.layers.0.mlp.fc1.weight"],
    )


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_missing_tracker_fails_at_start(capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        cli.check_args(parser, parser.parse_args(["--report_to", "wandb"]))
    assert "pip install wandb" in capsys.readouterr().err


@pytest.mark.slow
def test_csv_training_with_zero_shot_on_a_labelled_validation_file(tmp_path):
    from hf_switchback.training.synthetic import SyntheticShapes, zeroshot_classnames

    def write_csv(name, data, n):
        rows = ["path,text,label"]
        for i in range(n):
            sample = data[i]
            sample["image"].save(tmp_path / f"{name}{i}.png")
            rows.append(f"{name}{i}.png,{sample['caption']},{sample['label']}")
        (tmp_path / f"{name}.csv").write_text("\n".join(rows))

    write_csv("train", SyntheticShapes(32, image_size=32), 32)
    write_csv("val", SyntheticShapes(16, image_size=32, split="eval"), 16)
    out = tmp_path / "run"
    launch(
        [SCRIPT, "--model_config", write_tiny_model_config(str(tmp_path / "config.json")),
         "--train_file", str(tmp_path / "train.csv"), "--validation_file", str(tmp_path / "val.csv"),
         "--image_column", "path", "--caption_column", "text", "--zeroshot_label_column", "label",
         "--zeroshot_classnames", ",".join(zeroshot_classnames()), "--zeroshot_templates", "a {}",
         "--max_train_steps", "2", "--batch_size", "8", "--num_workers", "0", "--output_dir", str(out)],
    )  # fmt: skip
    results = read_results(out)
    assert results["eval_samples"] == 16 and results["train_steps"] == 2
    assert results["zero_shot_top1"] is not None and 0.0 <= results["zero_shot_top1"] <= 1.0
