"""examples/train_clip.py end to end: --help, argument checks, the default run learning, exact resume."""

import importlib.util
import io
import json
import math
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

from hf_switchback.training import cli, model_setup, runtime


def help_entries(text: str) -> dict[str, str]:
    """{first flag: its help, whitespace joined} from argparse's --help text."""
    entries, current = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif line.startswith("    ") and current:
            entries[current] += " " + line
        else:
            current = None
    return {flag: " ".join(help.split()) for flag, help in entries.items()}


def assert_accuracy_over(results: dict, key: str, n: int) -> None:
    """results[key] is a fraction of `n` samples: a real accuracy over the eval set, not just any number."""
    hits = results[key] * n
    assert abs(hits - round(hits)) < 1e-6 and 0 <= round(hits) <= n, (key, results[key], n)


def test_help_lists_every_flag_with_help_and_its_default_once():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    entries = help_entries(proc.stdout)
    entries.pop("-h")
    assert len(entries) > 60 and "--weight_scaling" in entries
    for help in entries.values():
        assert help.count("(default:") == 1, help
        assert "(default: None)" not in help, help
    # the SwitchBack flags show the library's real defaults, not argparse's None
    assert entries["--weight_scaling"].endswith("(default: tensor)")
    assert entries["--precision"].endswith("(default: int8)")
    assert entries["--grad_precision"].endswith("(default: auto)")
    assert entries["--memory_efficient"].endswith("(default: False)")
    parser = cli.build_parser()
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in proc.stdout, flag
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"
    for group in ("model", "SwitchBack", "data", "optimization", "speed and memory", "checkpoints"):
        assert group in proc.stdout


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
        (["--compile_scope", "blocks"], "--compile_scope needs --torch_compile"),
        (
            [
                "--torch_compile",
                "--compile_scope",
                "blocks",
                "--compile_mode",
                "reduce-overhead",
                "--gradient_checkpointing",
            ],
            "cannot recompute layers",
        ),
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


def test_run_clip_flag_names_are_aliases_of_ours():
    parser = cli.build_parser()
    args = parser.parse_args(
        ["--per_device_train_batch_size", "32", "--learning_rate", "1e-4", "--max_steps", "7", "--bf16",
         "--adam_epsilon", "1e-8", "--save_total_limit", "5", "--tokenizer_name", "tok"]
    )  # fmt: skip
    assert (args.batch_size, args.lr, args.max_train_steps, args.mixed_precision) == (32, 1e-4, 7, "bf16")
    assert (args.eps, args.checkpoints_total_limit, args.tokenizer_name_or_path) == (1e-8, 5, "tok")
    assert parser.parse_args(["--fp16"]).mixed_precision == "fp16"
    assert parser.parse_args([]).mixed_precision is None  # the accelerate config decides


def test_compile_mode_reaches_accelerate_and_picks_the_gemm(monkeypatch):
    """--compile_mode becomes accelerate's dynamo mode; CUDA graphs on Hopper put the TMA GEMM into the run's
    KernelOptions (and only there: the portable GEMM stays elsewhere)."""
    from hf_switchback import KernelOptions

    parser = cli.build_parser()
    assert runtime.dynamo_plugin(parser.parse_args([])) is None
    plugin = runtime.dynamo_plugin(parser.parse_args(["--torch_compile"]))
    assert plugin.backend.value.lower() == "inductor" and plugin.mode == "default"
    assert plugin.use_regional_compilation  # the default scope: per block
    whole = runtime.dynamo_plugin(parser.parse_args(["--torch_compile", "--compile_scope", "model"]))
    assert not whole.use_regional_compilation
    graphs = parser.parse_args(["--torch_compile", "--compile_mode", "reduce-overhead"])
    monkeypatch.setattr(runtime, "tma_gemm_available", lambda: False)
    assert runtime.dynamo_plugin(graphs).mode == "reduce-overhead"
    assert not runtime.dynamo_plugin(graphs).use_regional_compilation  # CUDA graphs: the whole model
    assert model_setup.switchback_config(graphs).kernel_options == KernelOptions(use_tma=False)
    monkeypatch.setattr(runtime, "tma_gemm_available", lambda: True)
    assert (
        model_setup.switchback_config(parser.parse_args(["--torch_compile"])).kernel_options.use_tma is False
    )
    assert model_setup.switchback_config(graphs).kernel_options == KernelOptions(use_tma=True)


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
    # the run's mean contrastive loss sits below chance level, ln(batch)
    assert 0 < results["train_loss"] < math.log(results["global_batch_size"]), results
    assert results["train_samples_per_second"] > 0
    # the final model: CLIP safetensors with its processor (config.json: SwitchBack's quantization_config)
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
    common = [SCRIPT, "--model_config", config, "--train_shards", str(shards), "--allow_synthetic_tokenizer",
              "--max_train_steps", "6",
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
    assert results["train_steps"] == 3
    assert_accuracy_over(results, "zero_shot_top1", results["eval_samples"])
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
         "--allow_synthetic_tokenizer",
         "--image_column", "path", "--caption_column", "text", "--zeroshot_label_column", "label",
         "--zeroshot_classnames", ",".join(zeroshot_classnames()), "--zeroshot_templates", "a {}",
         "--max_train_steps", "2", "--batch_size", "8", "--num_workers", "0", "--output_dir", str(out)],
    )  # fmt: skip
    results = read_results(out)
    assert results["eval_samples"] == 16 and results["train_steps"] == 2
    assert_accuracy_over(results, "zero_shot_top1", 16)  # the 16 labelled rows of val.csv
    assert results["zero_shot_top5"] >= results["zero_shot_top1"]


@pytest.mark.slow
def test_memory_switch_keeps_the_default_loss(tmp_path):
    """--memory_efficient --fuse_mlp (8-bit saved inputs, the MLP's h recomputed) against the default on the
    embedded data: the same forward, so the first loss agrees to float32 rounding; afterwards only dW differs
    (from the dequantized 8-bit input), so the losses and the weights' updates stay close to the default's."""
    import torch
    from safetensors.torch import load_file
    from transformers import CLIPConfig, CLIPModel

    config = write_tiny_model_config(str(tmp_path / "config.json"))
    common = [SCRIPT, "--model_config", config, "--max_train_steps", "16", "--batch_size", "16",
              "--logging_steps", "1", "--log_losses", "--eval_steps", "0", "--max_eval_samples", "16",
              "--lr", "2e-3", "--warmup_steps", "2"]  # fmt: skip
    default = logged_losses(launch([*common, "--output_dir", str(tmp_path / "default")]).stdout)
    memory = logged_losses(
        launch([*common, "--memory_efficient", "--fuse_mlp", "--output_dir", str(tmp_path / "mem")]).stdout
    )
    assert sorted(default) == sorted(memory) == list(range(1, 17))
    assert memory[1] == pytest.approx(default[1], rel=1e-4)
    late = [abs(memory[s] - default[s]) / default[s] for s in range(9, 17)]
    assert sum(late) / len(late) < 0.03, (default, memory)
    # The loss of so short a run sits near its ln(batch) plateau, so it alone would not notice a lost weight
    # gradient: each swapped weight's update must stay near the default's. A lost dW leaves the update ~0
    # (relative difference ~1.0); measured 0.10 (fc1: the fused block's recompute path) and 0.27 (q_proj: the
    # separate layers' 8-bit saved input), Adam turning dW's small 8-bit differences on near-zero gradient
    # entries into whole-size steps.
    torch.manual_seed(0)  # the script's --seed 0: the same initial weights
    initial = CLIPModel(CLIPConfig.from_json_file(config)).state_dict()
    runs = [load_file(tmp_path / run / "model.safetensors") for run in ("default", "mem")]
    layer = "vision_model.encoder.layers.0"
    for name, bound in ((f"{layer}.mlp.fc1.weight", 0.25), (f"{layer}.self_attn.q_proj.weight", 0.5)):
        step_default, step_memory = (run[name] - initial[name] for run in runs)
        assert (step_memory - step_default).norm() < bound * step_default.norm(), name
