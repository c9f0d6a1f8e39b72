"""Inference mode: cached 8-bit weights, same outputs as the training forward, reversible, no weight re-quantization."""

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_clip_config
from transformers import CLIPModel

from hf_switchback import (
    SwitchBackConfig,
    apply_switchback,
    prepare_for_inference,
    restore_training,
    switchback_inference,
    switchback_modules,
)
from hf_switchback.kernels import reference
from hf_switchback.weight_cache import WEIGHT_Q, WEIGHT_SCALE

CONFIGS = [
    SwitchBackConfig(backend="torch"),
    SwitchBackConfig(weight_scaling="row", backend="torch"),
    SwitchBackConfig(precision="fp8", backend="torch"),
]

# Worst per-sample cosine vs the 16-bit model. Measured on this width-32 random model over 3 seeds (min of
# image, text): int8 >= 0.9987, fp8 e4m3 >= 0.973 (3 mantissa bits; the text tower pools one token).
MIN_COSINE = {"int8": 0.995, "fp8": 0.95}


def _inputs(batch: int = 4):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 64, (batch, 8), generator=g)
    ids[:, 0], ids[:, -1] = 0, 1
    return {"input_ids": ids, "pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}


def _models(config):
    """(16-bit reference CLIPModel, SwitchBack copy with the same weights)."""
    ref = CLIPModel(tiny_clip_config()).eval()
    sb = CLIPModel(tiny_clip_config())
    sb.load_state_dict(ref.state_dict())
    return ref, apply_switchback(sb, config).eval()


def _embeddings(model, inputs):
    out = model(**inputs)
    return out.image_embeds, out.text_embeds


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.variant)
def test_inference_matches_training_forward(config):
    _, model = _models(config)
    inputs = _inputs()
    with torch.no_grad():
        before = _embeddings(model, inputs)  # training numerics: weight quantized inside each call
        prepare_for_inference(model)
        after = _embeddings(model, inputs)
    # The cache holds exactly what each call would compute from the same weight, and the same kernels
    # run: equal up to float reassociation (none on the CPU reference path).
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.variant)
def test_embeddings_close_to_16bit_model(config):
    ref, model = _models(config)
    inputs = _inputs(8)
    prepare_for_inference(model)
    with torch.inference_mode():
        for ours, theirs in zip(_embeddings(model, inputs), _embeddings(ref, inputs), strict=True):
            cos = F.cosine_similarity(ours.float(), theirs.float(), dim=-1)
            assert cos.min() > MIN_COSINE[config.precision], cos


def test_no_weight_quantization_per_call(monkeypatch):
    config = SwitchBackConfig(backend="torch")  # tensor-wise weights: only weights use quantize_tensorwise
    _, model = _models(config)
    prepare_for_inference(model)
    calls = {"rowwise": [], "tensorwise": 0}
    real_rowwise = reference.quantize_rowwise

    def rowwise(x, qdtype=torch.int8, *, options=None):
        calls["rowwise"].append(tuple(x.shape))
        return real_rowwise(x, qdtype)

    def tensorwise(x, qdtype=torch.int8, *, options=None):
        calls["tensorwise"] += 1
        raise AssertionError("weight quantized at call time")

    monkeypatch.setattr(reference, "quantize_rowwise", rowwise)
    monkeypatch.setattr(reference, "quantize_tensorwise", tensorwise)
    inputs = _inputs()
    with torch.no_grad():
        out = model(**inputs)
    assert calls["tensorwise"] == 0
    # One activation quantization per SwitchBack layer, and every one has tokens as rows (not a weight).
    tokens = {inputs["input_ids"].numel(), 4 * (1 + (16 // 8) ** 2)}  # text tokens, image patches + cls
    assert len(calls["rowwise"]) == len(switchback_modules(model))
    assert {shape[0] for shape in calls["rowwise"]} == tokens
    assert out.logits_per_image.grad_fn is None


def test_cache_is_not_in_state_dict_and_follows_restore():
    config = SwitchBackConfig(weight_scaling="row", backend="torch")
    _, model = _models(config)
    keys = set(model.state_dict())
    prepare_for_inference(model)
    layer = model.text_model.encoder.layers[0].mlp.fc1
    assert layer._buffers[WEIGHT_Q].dtype == torch.int8 and layer._buffers[WEIGHT_SCALE].shape == (64,)
    assert set(model.state_dict()) == keys and not model.training

    restore_training(model)
    assert model.training and set(model.state_dict()) == keys
    assert all(WEIGHT_Q not in m._buffers for m in switchback_modules(model).values())


def test_restore_training_trains_like_never_prepared():
    config = SwitchBackConfig(backend="torch")
    _, model = _models(config)
    _, fresh = _models(config)
    fresh.load_state_dict(model.state_dict())
    prepare_for_inference(model)
    with torch.no_grad():
        model(**_inputs())
    restore_training(model)
    fresh.train()
    grads = []
    for m in (model, fresh):
        m(**_inputs(), return_loss=True).loss.backward()
        grads.append(m.vision_model.encoder.layers[1].mlp.fc2.weight.grad)
    assert grads[0] is not None and torch.equal(grads[0], grads[1])


def test_stale_cache_raises():
    config = SwitchBackConfig(backend="torch")
    _, model = _models(config)
    prepare_for_inference(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # bumps _version, as torch optimizers do
    with torch.no_grad(), pytest.raises(RuntimeError, match="weight changed"):
        model(**_inputs())
    prepare_for_inference(model)  # re-quantizing the updated weights makes it usable again
    with torch.no_grad():
        model(**_inputs())


class DataOnlyUpdate(torch.optim.Optimizer):
    """Adds 0.01 to every parameter through `.data`, as bitsandbytes' 8-bit optimizers write through their
    kernels: no version counter moves."""

    def __init__(self, params) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(0.01)


def test_grad_enabled_forward_uses_training_path_and_drops_the_cache():
    # An optimizer step may follow that changes weights without bumping _version (bitsandbytes 8-bit
    # optimizers write through kernels), so a training forward must not leave a cache behind to go stale.
    from hf_switchback import switchback_modules
    from hf_switchback.weight_cache import has_weight_cache

    config = SwitchBackConfig(backend="torch")
    _, model = _models(config)
    _, twin = _models(config)  # never prepared: the uncached SwitchBack forward
    prepare_for_inference(model)
    model(**_inputs(), return_loss=True).loss.backward()  # grad enabled: the training path, with autograd
    assert not any(has_weight_cache(m) for m in switchback_modules(model).values())
    with torch.no_grad():
        stale = model(**_inputs()).logits_per_image
    DataOnlyUpdate(model.parameters()).step()  # an optimizer write that does not bump _version
    with torch.no_grad():
        out = model(**_inputs()).logits_per_image
        twin.load_state_dict(model.state_dict())
        expected = twin(**_inputs()).logits_per_image
    assert torch.equal(out, expected) and not torch.equal(out, stale)


def test_context_manager_restores_previous_mode():
    _, model = _models(SwitchBackConfig(backend="torch"))
    model.train()
    with switchback_inference(model) as m:
        assert m is model and not model.training
        assert all(WEIGHT_Q in layer._buffers for layer in switchback_modules(model).values())
    assert model.training
    assert all(WEIGHT_Q not in layer._buffers for layer in switchback_modules(model).values())


def test_prepare_rejects_model_without_switchback():
    with pytest.raises(ValueError, match="no SwitchBackLinear"):
        prepare_for_inference(CLIPModel(tiny_clip_config()))


def test_min_tokens_fallback_uses_16bit_weight():
    config = SwitchBackConfig(backend="torch", min_tokens=10_000)
    ref, model = _models(config)
    prepare_for_inference(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**_inputs()).logits_per_image, ref(**_inputs()).logits_per_image)


def test_cached_path_rejects_integer_input_like_the_training_path():
    _, model = _models(SwitchBackConfig(backend="torch"))
    prepare_for_inference(model)
    layer = model.vision_model.encoder.layers[0].mlp.fc1
    with torch.no_grad(), pytest.raises(TypeError, match="floating-point input"):
        layer(torch.ones(3, layer.in_features, dtype=torch.int64))
