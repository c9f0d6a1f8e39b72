"""transformers integration: from_pretrained(quantization_config=SwitchBackConfig), checkpoints, Trainer, fp8 guard.

Everything runs on tiny CLIPModels saved to temp dirs (no downloads). The reference for "which modules get
swapped" is computed here from module names, independently of find_targets.
"""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import tiny_clip_config
from safetensors.torch import load_file
from torch import nn
from transformers import CLIPModel

import hf_switchback
from hf_switchback import (
    DEFAULT_TARGET_MODULES,
    SwitchBackConfig,
    SwitchBackLinear,
    apply_switchback,
    strip_quantization_config,
    switchback_modules,
)

ROW = SwitchBackConfig(weight_scaling="row", backend="torch")


def _inputs(batch: int = 4):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 64, (batch, 8), generator=g)
    ids[:, 0], ids[:, -1] = 0, 1  # bos ... eos: CLIP pools the text at the eos token
    return {"input_ids": ids, "pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}


def _expected_targets(model: nn.Module, leaf_names) -> set[str]:
    return {
        n for n, m in model.named_modules() if type(m) is nn.Linear and n.rsplit(".", 1)[-1] in leaf_names
    }


@pytest.fixture
def saved_clip(tmp_path):
    """A plain tiny CLIPModel saved with save_pretrained; returns (dir, model)."""
    model = CLIPModel(tiny_clip_config())
    path = tmp_path / "plain"
    model.save_pretrained(path)
    return path, model


def test_registered_with_transformers():
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    assert AUTO_QUANTIZER_MAPPING["switchback"] is hf_switchback.SwitchBackHfQuantizer
    loaded = AUTO_QUANTIZATION_CONFIG_MAPPING["switchback"].from_dict(ROW.to_dict())
    assert loaded == ROW
    hf_switchback.quantizer.register()  # idempotent: a second registration must not raise


def test_from_pretrained_swaps_exactly_the_targets(saved_clip):
    path, plain = saved_clip
    model = CLIPModel.from_pretrained(path, quantization_config=ROW)

    expected = _expected_targets(plain, DEFAULT_TARGET_MODULES)
    assert len(expected) == 2 * 2 * 6  # 2 towers x 2 layers x (q, k, v, out, fc1, fc2)
    assert set(switchback_modules(model)) == expected
    assert all(m.switchback_config == ROW for m in switchback_modules(model).values())
    assert type(model.visual_projection) is nn.Linear and type(model.text_projection) is nn.Linear
    assert model.is_quantized and model.config.quantization_config == ROW
    # Weights are the checkpoint's, unchanged (SwitchBack quantizes on the fly, never at load).
    sd = model.state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(sd[name], value), name


def test_from_pretrained_matches_apply_switchback(saved_clip):
    path, _ = saved_clip
    loaded = CLIPModel.from_pretrained(path, quantization_config=ROW)
    converted = apply_switchback(CLIPModel.from_pretrained(path), ROW)
    with torch.no_grad():
        a, b = loaded(**_inputs()), converted(**_inputs())
    # Same weights, same deterministic kernels: bit-identical.
    assert torch.equal(a.logits_per_image, b.logits_per_image)
    assert torch.equal(a.text_embeds, b.text_embeds)


def test_from_pretrained_custom_targets(saved_clip):
    path, plain = saved_clip
    model = CLIPModel.from_pretrained(path, quantization_config=SwitchBackConfig(target_modules=["fc1"]))
    assert set(switchback_modules(model)) == _expected_targets(plain, ("fc1",))
    with pytest.raises(ValueError, match=r"no nn\.Linear matched"):
        CLIPModel.from_pretrained(path, quantization_config=SwitchBackConfig(target_modules=["nope"]))


def test_checkpoint_is_plain_safetensors(saved_clip, tmp_path):
    path, _ = saved_clip
    model = CLIPModel.from_pretrained(path, quantization_config=ROW, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "sb")
    CLIPModel.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(tmp_path / "ref")

    ours, ref = (
        load_file(tmp_path / "sb" / "model.safetensors"),
        load_file(tmp_path / "ref" / "model.safetensors"),
    )
    assert ours.keys() == ref.keys()
    for key, tensor in ref.items():
        assert ours[key].dtype == tensor.dtype == torch.bfloat16, key
        assert torch.equal(ours[key], tensor), key
    assert sorted(os.listdir(tmp_path / "sb")) == sorted(os.listdir(tmp_path / "ref"))
    config = json.loads((tmp_path / "sb" / "config.json").read_text())
    assert config["quantization_config"] == {**ROW.to_dict(), "quant_method": "switchback"}
    assert "quantization_config" not in json.loads((tmp_path / "ref" / "config.json").read_text())


_RELOAD = textwrap.dedent(
    """
    import json, logging, sys
    {imports}
    from safetensors.torch import save_file
    from transformers import CLIPModel
    from transformers.utils import logging as hf_logging

    records = []
    hf_logging.get_logger("transformers").addHandler(type("H", (logging.Handler,), {{"emit": lambda s, r: records.append(r.getMessage())}})())
    model = CLIPModel.from_pretrained(sys.argv[1])
    save_file({{k: v.contiguous() for k, v in model.state_dict().items()}}, sys.argv[2])
    out = model(input_ids=__import__("torch").tensor([[0, 5, 6, 1]]), pixel_values=__import__("torch").ones(1, 3, 16, 16))
    print(json.dumps({{
        "classes": sorted({{type(m).__name__ for m in model.modules()}}),
        "hf_switchback_loaded": "hf_switchback" in sys.modules,
        "quantizer": type(getattr(model, "hf_quantizer", None)).__name__,
        "finite": bool(out.logits_per_image.isfinite().all()),
        "warned": any("Unknown quantization type, got switchback" in m for m in records),
    }}))
    """
)


def _reload_in_subprocess(checkpoint, out_file, with_import: bool) -> dict:
    script = _RELOAD.format(imports="import hf_switchback" if with_import else "")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "warning"}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(checkpoint), str(out_file)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_reload_in_fresh_process_with_and_without_hf_switchback(saved_clip, tmp_path):
    path, _ = saved_clip
    model = CLIPModel.from_pretrained(path, quantization_config=ROW)
    model.save_pretrained(tmp_path / "sb")
    saved = {k: v for k, v in model.state_dict().items()}

    with_sb = _reload_in_subprocess(tmp_path / "sb", tmp_path / "with.safetensors", with_import=True)
    without = _reload_in_subprocess(tmp_path / "sb", tmp_path / "without.safetensors", with_import=False)

    assert "SwitchBackLinear" in with_sb["classes"] and with_sb["quantizer"] == "SwitchBackHfQuantizer"
    assert "SwitchBackLinear" not in without["classes"] and without["quantizer"] == "NoneType"
    assert not without["hf_switchback_loaded"] and without["finite"] and with_sb["finite"]
    # What transformers 5.x does without the plugin: warn and load a plain model (it does not raise).
    assert without["warned"] and not with_sb["warned"]
    for name in ("with", "without"):
        reloaded = load_file(tmp_path / f"{name}.safetensors")
        assert reloaded.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(reloaded[key], value), (name, key)


def test_reload_keeps_the_checkpoint_config_over_the_argument(saved_clip, tmp_path):
    path, _ = saved_clip
    CLIPModel.from_pretrained(path, quantization_config=ROW).save_pretrained(tmp_path / "sb")
    other = SwitchBackConfig(precision="fp8", backend="torch")
    # transformers' rule for pre-quantized checkpoints: config.json wins, with a warning.
    with pytest.warns(UserWarning, match="quantization_config` from the model will be used"):
        model = CLIPModel.from_pretrained(tmp_path / "sb", quantization_config=other)
    assert {m.switchback_config for m in switchback_modules(model).values()} == {ROW}


def test_strip_quantization_config(saved_clip, tmp_path):
    path, _ = saved_clip
    model = CLIPModel.from_pretrained(path, quantization_config=ROW)
    model.save_pretrained(tmp_path / "dir")
    strip_quantization_config(tmp_path / "dir")
    assert "quantization_config" not in json.loads((tmp_path / "dir" / "config.json").read_text())
    assert not switchback_modules(CLIPModel.from_pretrained(tmp_path / "dir"))

    strip_quantization_config(model)  # in memory: the layers stay, the config goes
    assert switchback_modules(model) and not model.is_quantized
    model.save_pretrained(tmp_path / "mem")
    assert "quantization_config" not in json.loads((tmp_path / "mem" / "config.json").read_text())


def test_dequantize_returns_plain_linears(saved_clip):
    path, plain = saved_clip
    model = CLIPModel.from_pretrained(path, quantization_config=ROW)
    weight = model.vision_model.encoder.layers[0].mlp.fc1.weight
    model = model.dequantize()
    assert not switchback_modules(model) and not hasattr(model.config, "quantization_config")
    assert model.vision_model.encoder.layers[0].mlp.fc1.weight is weight  # same Parameter, no copy
    with torch.no_grad():
        torch.testing.assert_close(model(**_inputs()).logits_per_image, plain(**_inputs()).logits_per_image)


def _clip_batches(n: int, batch: int):
    """A fixed set of image/text pairs (memorizable, so the contrastive loss must go down)."""
    data = _inputs(batch)
    return [{"input_ids": data["input_ids"][i], "pixel_values": data["pixel_values"][i]} for i in range(n)]


def _collate(features):
    return {
        "input_ids": torch.stack([f["input_ids"] for f in features]),
        "pixel_values": torch.stack([f["pixel_values"] for f in features]),
        "return_loss": True,
    }


def _cpu_trainer(model, tmp_path, **arguments):
    """An HF Trainer of `model` on the CPU over _clip_batches(8, 8), a loss logged every step, no saves."""
    from transformers import Trainer, TrainingArguments

    model.train()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        **arguments,
    )
    return Trainer(model=model, args=args, train_dataset=_clip_batches(8, 8), data_collator=_collate)


@pytest.mark.slow
def test_trainer_trains_and_save_model_round_trips(saved_clip, tmp_path):
    path, _ = saved_clip
    model = CLIPModel.from_pretrained(path, quantization_config=ROW)
    trainer = _cpu_trainer(model, tmp_path, max_steps=10, learning_rate=3e-3, warmup_steps=0, seed=0)
    trainer.train()

    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 10
    # log(8) ~ 2.08 at chance; memorizing 8 pairs must get far below the first steps.
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses
    assert isinstance(trainer.model.vision_model.encoder.layers[0].mlp.fc1, SwitchBackLinear)

    trainer.save_model(str(tmp_path / "saved"))
    reloaded = CLIPModel.from_pretrained(tmp_path / "saved")
    assert set(switchback_modules(reloaded)) == set(switchback_modules(model))
    trained = model.state_dict()
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, trained[key]), key


def test_trainer_torch_compile_per_layer_with_accelerates_regional_switch(saved_clip, tmp_path, monkeypatch):
    """README: `TrainingArguments(torch_compile=True)` compiles the whole model; accelerate's environment switch,
    which the Trainer's dynamo plugin reads, compiles each encoder layer instead (the short first step,
    BENCHMARKS.md compile warm-up). Checks the documented route still reaches SwitchBack's layers and trains."""
    from torch._dynamo.eval_frame import OptimizedModule

    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "1")
    path, _ = saved_clip
    model = CLIPModel.from_pretrained(path, quantization_config=ROW)
    # aot_eager: the CPU stand-in for inductor, the same Dynamo regions
    trainer = _cpu_trainer(
        model, tmp_path, max_steps=2, torch_compile=True, torch_compile_backend="aot_eager"
    )
    trainer.train()

    assert trainer.accelerator.state.dynamo_plugin.use_regional_compilation
    trained = trainer.model_wrapped
    assert not isinstance(trained, OptimizedModule)  # not the whole model ...
    for tower in (trained.vision_model, trained.text_model):
        layer = tower.encoder.layers[0]
        assert isinstance(layer, OptimizedModule), type(layer)  # ... each layer
        assert switchback_modules(layer._orig_mod)  # with SwitchBack inside
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


# ---- accelerate fp8 interplay --------------------------------------------------------------------------


def test_fp8_env_blocks_from_pretrained_and_apply(saved_clip, monkeypatch):
    path, _ = saved_clip
    monkeypatch.setenv(
        "ACCELERATE_MIXED_PRECISION", "fp8"
    )  # what `accelerate launch --mixed_precision fp8` sets
    with pytest.raises(RuntimeError, match="mixed_precision='fp8'"):
        CLIPModel.from_pretrained(path, quantization_config=ROW)
    model = CLIPModel(tiny_clip_config())
    with pytest.raises(RuntimeError, match="mixed_precision='fp8'"):
        apply_switchback(model, ROW)
    assert not switchback_modules(model)  # failed before the first swap: nothing half converted


def test_fp8_accelerator_state_blocks_apply(monkeypatch):
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    model = CLIPModel(tiny_clip_config())
    apply_switchback(CLIPModel(tiny_clip_config()), ROW)  # no accelerate state: fine
    # An Accelerator(mixed_precision="fp8") created earlier in the process leaves this in its shared state.
    monkeypatch.setitem(AcceleratorState._shared_state, "_mixed_precision", "fp8")
    with pytest.raises(RuntimeError, match="Transformer Engine / torchao"):
        apply_switchback(model, ROW)
    with pytest.raises(RuntimeError, match="mixed_precision='fp8'"):
        hf_switchback.check_fp8_interop(_hand_built_switchback_model())


def _hand_built_switchback_model() -> nn.Module:
    """A SwitchBack model built by hand (as if converted before the Accelerator existed)."""
    lin = nn.Linear(8, 8)
    wrapper = nn.Sequential(lin)
    with torch.device("meta"):
        sb = SwitchBackLinear(8, 8, config=ROW)
    sb.weight, sb.bias = lin.weight, lin.bias
    wrapper[0] = sb
    return wrapper


def test_check_fp8_interop_rejects_foreign_linears(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)

    class Float8Linear(nn.Linear):  # stands in for torchao's / bitsandbytes' nn.Linear subclasses
        pass

    model = nn.Sequential(SwitchBackLinear.from_linear(nn.Linear(4, 4), ROW), Float8Linear(4, 4))
    with pytest.raises(RuntimeError, match=r"1 \(Float8Linear\)"):
        hf_switchback.check_fp8_interop(model)
    hf_switchback.check_fp8_interop(nn.Sequential(Float8Linear(4, 4)))  # no SwitchBack: not our business
    hf_switchback.check_fp8_interop(nn.Sequential(SwitchBackLinear.from_linear(nn.Linear(4, 4), ROW)))


def test_config_json_with_a_catastrophic_regex_is_refused_at_once(saved_clip):
    path, _ = saved_clip
    with open(path / "config.json") as f:
        config = json.load(f)
    # re.fullmatch of this on a long module name was still running after 40 s
    config["quantization_config"] = {"quant_method": "switchback", "target_modules": "([a-z_.0-9]+)+Z"}
    with open(path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"target_modules: regex .*\(nested quantifiers\)"):
        CLIPModel.from_pretrained(path)
