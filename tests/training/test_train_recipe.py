"""examples/train_clip.py with the paper's stability recipe: --optimizer (every choice), --layer_scale_init (folded
checkpoint, resume), --spike_monitor (rms logs, warnings, plot).

Most runs call the script's training_function in this process (about a second each, against ~12 s for a launch
that imports torch, transformers and bitsandbytes again); one 2-process launch covers the CLI and DDP names.
"""

import os
import shutil

import pytest
import torch
from train_helpers import SCRIPT, launch, load_script, read_results, run_in_process, tiny_config

from hf_switchback.training.cli import build_parser, check_args
from hf_switchback.training.optim import OPTIMIZER_CHOICES
from hf_switchback.training.runtime import check_deepspeed

# hidden 64: fc1/fc2 weights (8192 elements) and the token embedding (4096) reach bitsandbytes' min_8bit_size
# (4096), so the 8-bit optimizers really keep 8-bit states for them — unless told to keep them 32-bit.
HIDDEN = 64
TOKEN_EMBEDDING = "clip.text_model.embeddings.token_embedding.weight"
FC1 = "clip.text_model.encoder.layers.0.mlp.fc1.weight"


@pytest.fixture(scope="module")
def script():
    return load_script("train_clip_recipe")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "config.json"
    tiny_config(hidden=HIDDEN).to_json_file(str(path))
    return str(path)


@pytest.fixture
def run(script, config_file, tmp_path, monkeypatch):
    """run(*flags) -> (results, output dir, {"model": CLIPForContrastive, "optimizer": ...}) of a 3-step run."""
    built = {}
    wrapper, factory = script.CLIPForContrastive, script.create_optimizer

    def record_model(clip):
        built["model"] = wrapper(clip)
        return built["model"]

    def record_optimizer(*args, **kwargs):
        built["optimizer"] = factory(*args, **kwargs)
        return built["optimizer"]

    monkeypatch.setattr(script, "CLIPForContrastive", record_model)
    monkeypatch.setattr(script, "create_optimizer", record_optimizer)

    def _run(*flags, output_dir=None):
        out = str(output_dir or tmp_path / "run")
        results = run_in_process(
            script,
            ["--model_config", config_file, "--max_train_steps", "3", "--batch_size", "8", "--num_workers", "0",
             "--synthetic_train_samples", "64", "--eval_steps", "0", "--max_eval_samples", "16",
             "--logging_steps", "1", "--output_dir", out, *flags],
        )  # fmt: skip
        return results, out, dict(built)

    return _run


def _8bit(optimizer, name: str, model) -> bool:
    param = dict(model.named_parameters())[name]
    return optimizer.state[param]["state2"].dtype == torch.uint8


@pytest.mark.parametrize("optimizer", OPTIMIZER_CHOICES)  # every choice, a new one included
def test_every_optimizer_trains(run, script, optimizer):
    results, out, built = run("--optimizer", optimizer)
    assert results["train_steps"] == 3 and torch.isfinite(torch.tensor(results["train_loss"]))
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    assert type(built["optimizer"]).__name__.lower() == optimizer.replace("_", "")
    if "8bit" in optimizer:
        # big matrices 8-bit; the embedding table fp32 through keep_32bit=unstable_parameters(model)
        assert _8bit(built["optimizer"], FC1, built["model"])
        assert not _8bit(built["optimizer"], TOKEN_EMBEDDING, built["model"])


def test_layer_scale_checkpoint_is_a_plain_clip_with_the_same_outputs(run, config_file):
    from safetensors.torch import load_file
    from train_helpers import fixed_batch
    from transformers import CLIPConfig, CLIPModel

    from hf_switchback.training.layer_scale import has_layer_scale

    _, out, built = run("--layer_scale_init", "0", "--switchback", "off", "--optimizer", "stableadamw")
    trained = built["model"].clip
    assert has_layer_scale(trained)
    scales = [p for n, p in trained.named_parameters() if "layer_scale" in n]
    assert len(scales) == 2 * 2  # (attention, MLP) x 1 layer x 2 towers
    assert all(s.abs().max() > 0 for s in scales)  # trained away from the zero init: the fold is not trivial

    state_dict = load_file(os.path.join(out, "model.safetensors"))
    assert not any("layer_scale" in k for k in state_dict)
    plain = CLIPModel(CLIPConfig.from_json_file(config_file))
    plain.load_state_dict(state_dict, strict=True)
    assert not has_layer_scale(CLIPModel.from_pretrained(out))

    batch = fixed_batch(4)
    trained.eval(), plain.eval()
    with torch.no_grad():
        want, got = trained(**batch), plain(**batch)
    for key in ("image_embeds", "text_embeds", "logits_per_image"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)


def test_layer_scale_resumes_exactly(run, tmp_path, capsys):
    flags = ("--layer_scale_init", "0.1", "--optimizer", "adamw", "--checkpointing_steps", "2")
    run(*flags, output_dir=tmp_path / "full")
    checkpoint = tmp_path / "full" / "checkpoints" / "step_2"
    assert any(
        "layer_scale" in k for k in _checkpoint_keys(checkpoint)
    )  # the training state keeps the scales
    shutil.copytree(checkpoint, tmp_path / "resumed" / "checkpoints" / "step_2")
    capsys.readouterr()
    results, _, _ = run(*flags, "--resume_from_checkpoint", "latest", output_dir=tmp_path / "resumed")
    # load_state is strict: the layer-scale Parameters of the new run took the checkpoint's values
    assert "resuming from" in capsys.readouterr().out
    assert results["train_steps"] == 3
    from safetensors.torch import load_file

    full = load_file(tmp_path / "full" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for key in full:
        torch.testing.assert_close(resumed[key], full[key], rtol=1e-6, atol=1e-6, msg=key)


def _checkpoint_keys(checkpoint) -> list[str]:
    from safetensors.torch import load_file

    files = [f for f in os.listdir(checkpoint) if f.startswith("model") and f.endswith(".safetensors")]
    assert files, os.listdir(checkpoint)
    return [k for f in files for k in load_file(checkpoint / f)]


def test_spike_monitor_logs_rms_warns_and_plots(run, script, monkeypatch, caplog):
    logged = []
    monkeypatch.setattr(
        script.Accelerator, "log", lambda self, values, step=None, **kw: logged.append(values)
    )
    # threshold far below the steady-state RMS (~1): every run crosses it, so the warning path runs
    results, out, _ = run("--spike_monitor", "--spike_threshold", "1e-3", "--optimizer", "adamw8bit")
    assert os.path.getsize(os.path.join(out, "spike_monitor.png")) > 1000
    train_logs = [v for v in logged if "train/loss" in v]
    assert len(train_logs) == 3
    for values in train_logs:
        rms = {k: v for k, v in values.items() if k.startswith("rms/")}
        # groups named like the model: the wrapper's "clip." is gone
        for group in ("max", "text_model.layers.0", "vision_model.layers.0", "logit_scale"):
            assert f"rms/{group}" in rms, sorted(rms)
        assert not any("clip." in k for k in rms)
        assert all(v >= 0 and v == v for v in rms.values())
        assert rms["rms/max"] == max(v for k, v in rms.items() if k != "rms/max")
    assert results["spike_monitor_warnings"] == 1  # warns on crossing, not on every step above
    assert "exceeds" in caplog.text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layer_scale_init", "nan"], "--layer_scale_init"),
        (["--spike_threshold", "0"], "--spike_threshold"),
    ],
)
def test_recipe_flags_are_checked(script, argv, message, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        check_args(parser, parser.parse_args(argv))
    assert message in capsys.readouterr().err


def test_spike_monitor_is_refused_under_deepspeed(script):
    args = build_parser().parse_args(["--spike_monitor"])
    with pytest.raises(ValueError, match="DeepSpeed"):
        check_deepspeed(None, args)


@pytest.mark.slow
def test_recipe_launched_on_two_ranks(tmp_path, config_file):
    """The CLI under DDP (gloo): names carry "module.clip."; the logged groups and the folded model must not."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import CLIPModel

    out = tmp_path / "run"
    launch(
        [SCRIPT, "--model_config", config_file, "--max_train_steps", "2", "--batch_size", "8",
         "--num_workers", "0", "--synthetic_train_samples", "64", "--eval_steps", "0", "--max_eval_samples", "16",
         "--logging_steps", "1", "--optimizer", "stableadamw", "--layer_scale_init", "0", "--spike_monitor",
         "--report_to", "tensorboard", "--output_dir", str(out)],
        num_processes=2,
    )  # fmt: skip
    assert read_results(out)["train_steps"] == 2
    assert (out / "spike_monitor.png").exists()
    from safetensors.torch import load_file

    assert not any("layer_scale" in k for k in load_file(out / "model.safetensors"))
    CLIPModel.from_pretrained(out)
    events = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if "tfevents" in f]
    tags = set()
    for path in events:
        acc = EventAccumulator(path)
        acc.Reload()
        tags |= set(acc.Tags().get("scalars", [])) | set(acc.Tags().get("tensors", []))
    assert "rms/max" in tags and "rms/text_model.layers.0" in tags, sorted(tags)
    assert not any("module" in t or "clip." in t for t in tags)
