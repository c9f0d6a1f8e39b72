"""Layer-scale: zero-init identity, the forward against a hand-written encoder layer, folding round trips."""

import copy

import pytest
import torch
from transformers import CLIPModel
from transformers.models.clip.modeling_clip import CLIPEncoderLayer

from hf_switchback import apply_switchback, remove_switchback
from hf_switchback.training.layer_scale import (
    LayerScale,
    add_layer_scale,
    fold_layer_scale,
    fold_layer_scale_state_dict,
    has_layer_scale,
)


def _inputs(config):
    ids = torch.randint(0, config.text_config.vocab_size, (2, 7))
    pixels = torch.randn(2, 3, config.vision_config.image_size, config.vision_config.image_size)
    return {"input_ids": ids, "pixel_values": pixels}


def _randomize_scales(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerScale):
                m.scale.uniform_(-2.0, 2.0)


def test_zero_init_is_identity_residual(clip_config):
    model = add_layer_scale(CLIPModel(clip_config).eval(), init=0.0)
    seen = []

    def check(module, args, kwargs, output):
        hidden_in = args[0] if args else kwargs["hidden_states"]
        seen.append(torch.equal(output, hidden_in))

    for layer in model.modules():
        if isinstance(layer, CLIPEncoderLayer):
            layer.register_forward_hook(check, with_kwargs=True)
    model(**_inputs(clip_config))
    assert len(seen) == 2 * clip_config.text_config.num_hidden_layers and all(seen)


def test_forward_matches_hand_written_layer(clip_config):
    """h1 = h + γ1 ⊙ attn(ln1(h)); out = h1 + γ2 ⊙ mlp(ln2(h1)), written out with the layer's own submodules."""
    layer = CLIPModel(clip_config).vision_model.encoder.layers[0].eval()
    container = torch.nn.ModuleList([layer])  # add_layer_scale finds CLIPEncoderLayers anywhere in a module
    add_layer_scale(container, init=1.0)
    _randomize_scales(container)
    h = torch.randn(2, 5, clip_config.vision_config.hidden_size)
    out = layer(h, attention_mask=None)
    with torch.no_grad():
        # call the branches' plain forwards (bypassing the hooks) to build the reference independently
        attn = type(layer.self_attn).forward(layer.self_attn, layer.layer_norm1(h), attention_mask=None)[0]
        h1 = h + layer.layer_scale1.scale * attn
        ref = h1 + layer.layer_scale2.scale * type(layer.mlp).forward(layer.mlp, layer.layer_norm2(h1))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    # the scales make a difference (so the comparison above is not trivially true)
    assert (ref - (h + attn)).abs().max() > 1e-2


def test_fold_state_dict_loads_into_plain_clip_with_same_outputs(clip_config):
    model = CLIPModel(clip_config).eval()
    plain_keys = set(model.state_dict())
    add_layer_scale(model, init=0.1)
    _randomize_scales(model)
    inputs = _inputs(clip_config)
    with torch.no_grad():
        expected = model(**inputs)
    sd = model.state_dict()
    folded = fold_layer_scale_state_dict(sd)
    assert set(folded) == plain_keys
    assert any(k.endswith("layer_scale1.scale") for k in sd)  # input untouched
    plain = CLIPModel(clip_config).eval()
    plain.load_state_dict(folded, strict=True)
    with torch.no_grad():
        got = plain(**inputs)
    for name in ("logits_per_image", "text_embeds", "image_embeds"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=1e-5, atol=1e-5)
    # without the fold the plain model would differ: the scales matter
    unfolded = {k: v for k, v in sd.items() if "layer_scale" not in k}
    plain.load_state_dict(unfolded, strict=True)
    with torch.no_grad():
        assert (plain(**inputs).text_embeds - expected.text_embeds).abs().max() > 1e-2


def test_fold_in_place_gives_plain_model(clip_config):
    model = CLIPModel(clip_config).eval()
    plain_keys = set(model.state_dict())
    add_layer_scale(model, init=0.0)
    assert has_layer_scale(model)
    with pytest.raises(ValueError, match="already has layer-scale"):
        add_layer_scale(model)
    _randomize_scales(model)
    inputs = _inputs(clip_config)
    with torch.no_grad():
        expected = model(**inputs).logits_per_image
        fold_layer_scale(model)
        got = model(**inputs).logits_per_image
    assert not has_layer_scale(model)
    assert set(model.state_dict()) == plain_keys
    assert all(not m._forward_hooks for m in model.modules())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_deepcopy_keeps_its_own_scales(clip_config):
    model = add_layer_scale(CLIPModel(clip_config).eval(), init=1.0)
    clone = copy.deepcopy(model)
    inputs = _inputs(clip_config)
    with torch.no_grad():
        before = model(**inputs).text_embeds
        _randomize_scales(clone)
        clone_out = clone(**inputs).text_embeds
        after = model(**inputs).text_embeds
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert (clone_out - before).abs().max() > 1e-2


def test_with_switchback_linear_trains_and_folds(clip_config):
    """apply_switchback then add_layer_scale: scales get gradients through SwitchBackLinear; folding scales the
    SwitchBackLinear weights in place, and after remove_switchback the model equals the float layer-scale model."""
    reference = add_layer_scale(CLIPModel(clip_config).eval(), init=1.0)
    _randomize_scales(reference)
    sb_model = copy.deepcopy(reference)
    # layer-scale first, SwitchBack second: the hooks live on self_attn/mlp, which the swap leaves in place
    apply_switchback(sb_model)
    out_proj = sb_model.vision_model.encoder.layers[0].self_attn.out_proj
    assert type(out_proj).__name__ == "SwitchBackLinear"
    inputs = _inputs(clip_config)
    sb_model.train()
    sb_model(**inputs).logits_per_image.square().mean().backward()
    scale = sb_model.vision_model.encoder.layers[0].layer_scale1.scale
    assert scale.grad is not None and scale.grad.abs().sum() > 0

    weight_before = out_proj.weight.detach().clone()
    fold_layer_scale(sb_model)
    torch.testing.assert_close(
        out_proj.weight.detach(), weight_before * scale.detach()[:, None], rtol=0, atol=0
    )
    remove_switchback(sb_model)
    sb_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            sb_model(**inputs).logits_per_image, reference(**inputs).logits_per_image, rtol=1e-5, atol=1e-5
        )
    plain = CLIPModel(clip_config)
    plain.load_state_dict(sb_model.state_dict(), strict=True)


def test_rejects_models_without_clip_layers():
    with pytest.raises(ValueError, match="no CLIPEncoderLayer"):
        add_layer_scale(torch.nn.Linear(4, 4))
