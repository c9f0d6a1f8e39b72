"""SwitchBack on transformers' SigLIP (SiglipModel, and Siglip2Model: same module names): default targets,
fused MLP blocks, the quantizer's from_pretrained path and checkpoints that load as plain models.

Tiny models from configs, no downloads. Expected targets are listed here from module names, independently
of find_targets.
"""

import pytest
import torch
from torch import nn
from transformers import Siglip2Config, Siglip2Model, SiglipConfig, SiglipModel

from hf_switchback import (
    DEFAULT_TARGET_MODULES,
    SwitchBackConfig,
    apply_switchback,
    strip_quantization_config,
    switchback_modules,
)
from hf_switchback.blocks.mlp import is_fused_mlp

TORCH = SwitchBackConfig(backend="torch")
# SigLIP's encoder layers name their linears as CLIP's do
PER_LAYER = (*(f"self_attn.{p}_proj" for p in ("q", "k", "v", "out")), "mlp.fc1", "mlp.fc2")
HEADS = ("text_model.head", "vision_model.head.mlp.fc1", "vision_model.head.mlp.fc2")


def tiny_config(cls=SiglipConfig, layers: int = 2):
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2)
    text = dict(
        tower, vocab_size=64, max_position_embeddings=16, bos_token_id=2, eos_token_id=3, pad_token_id=0
    )
    vision = dict(tower, patch_size=8) | ({"image_size": 16} if cls is SiglipConfig else {"num_patches": 4})
    return cls(text_config=text, vision_config=vision)


def inputs(model, n: int = 3):
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(4, 64, (n, 16), generator=g)}
    if isinstance(model, Siglip2Model):  # NaFlex: pre-cut patches, their mask and the patch grid
        batch["pixel_values"] = torch.randn(n, 4, 3 * 8 * 8, generator=g)
        batch["pixel_attention_mask"] = torch.ones(n, 4, dtype=torch.long)
        batch["spatial_shapes"] = torch.tensor([[2, 2]] * n)
    else:
        batch["pixel_values"] = torch.randn(n, 3, 16, 16, generator=g)
    return batch


def encoder_linears(layers: int = 2) -> set[str]:
    towers = ("text_model", "vision_model")
    return {f"{t}.encoder.layers.{i}.{s}" for t in towers for i in range(layers) for s in PER_LAYER}


@pytest.mark.parametrize("model_cls", [SiglipModel, Siglip2Model])
def test_defaults_swap_every_encoder_linear_and_keep_the_heads_16_bit(model_cls):
    config = tiny_config(SiglipConfig if model_cls is SiglipModel else Siglip2Config)
    model = apply_switchback(model_cls(config), TORCH)
    assert set(switchback_modules(model)) == encoder_linears()
    for name in (*HEADS, "vision_model.head.attention.out_proj"):
        assert isinstance(model.get_submodule(name), nn.Linear) and name not in switchback_modules(model)
    with torch.no_grad():
        out = model(**inputs(model))
    assert torch.isfinite(out.logits_per_image).all()
    # the heads when asked
    asked = TORCH.replace(target_modules=(*DEFAULT_TARGET_MODULES, "head"), exclude_modules=())
    asked = apply_switchback(model_cls(config), asked)
    assert set(switchback_modules(asked)) == encoder_linears() | set(HEADS)


def test_fuse_mlp_fuses_siglip_encoder_blocks():
    torch.manual_seed(0)
    plain = apply_switchback(SiglipModel(tiny_config()), TORCH)
    fused = apply_switchback(SiglipModel(tiny_config()), TORCH.replace(fuse_mlp=True))
    fused.load_state_dict(plain.state_dict())
    blocks = [n for n, m in fused.named_modules() if is_fused_mlp(m)]
    assert sorted(blocks) == sorted(
        f"{t}.encoder.layers.{i}.mlp" for t in ("text_model", "vision_model") for i in (0, 1)
    )
    with torch.no_grad():
        a, b = plain(**inputs(plain)), fused(**inputs(fused))
    assert torch.allclose(a.logits_per_image, b.logits_per_image, atol=1e-4)


@pytest.mark.parametrize("model_cls", [SiglipModel, Siglip2Model])
def test_quantizer_round_trip_and_plain_reload(model_cls, tmp_path):
    config = tiny_config(SiglipConfig if model_cls is SiglipModel else Siglip2Config)
    plain = model_cls(config)
    plain.save_pretrained(tmp_path / "plain")

    model = model_cls.from_pretrained(tmp_path / "plain", quantization_config=TORCH)
    assert set(switchback_modules(model)) == encoder_linears()
    assert model.is_quantized and model.config.quantization_config == TORCH
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    converted = apply_switchback(model_cls.from_pretrained(tmp_path / "plain"), TORCH)
    with torch.no_grad():
        expected = converted(**inputs(converted)).logits_per_image
        assert torch.equal(model(**inputs(model)).logits_per_image, expected)

    # saved with SwitchBack: reloading restores it from config.json; stripped, a plain model loads
    model.save_pretrained(tmp_path / "switchback")
    again = model_cls.from_pretrained(tmp_path / "switchback")
    assert set(switchback_modules(again)) == encoder_linears()
    strip_quantization_config(tmp_path / "switchback")
    bare = model_cls.from_pretrained(tmp_path / "switchback")
    assert not switchback_modules(bare) and not getattr(bare.config, "quantization_config", None)
    for name, value in plain.state_dict().items():
        assert torch.equal(bare.state_dict()[name], value), name


def test_compiled_per_layer_each_tower_traces_one_graph_as_the_stock_model_does():
    """A fused encoder layer returns a contiguous tensor where the stock layer keeps its input's layout, and
    SigLIP's vision embeddings are a transposed view: the encoder's pre-hook makes its input contiguous, else
    the first vision layer would compile a graph of its own (other strides than the layers after it)."""
    from hf_switchback import remove_switchback
    from hf_switchback.blocks.encoder_layer import _contiguous_input

    def dynamo_graphs(model) -> int:
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        for tower in (model.vision_model, model.text_model):
            for layer in tower.encoder.layers:
                layer.compile(dynamic=False, backend=backend)
        model(**inputs(model), return_loss=True).loss.backward()
        torch._dynamo.reset()
        return len(graphs)

    torch.manual_seed(0)
    assert dynamo_graphs(SiglipModel(tiny_config())) == 2
    model = apply_switchback(SiglipModel(tiny_config()), TORCH)
    encoder = model.vision_model.encoder
    assert _contiguous_input in encoder._forward_pre_hooks.values()
    assert dynamo_graphs(model) == 2
    remove_switchback(model)
    assert _contiguous_input not in encoder._forward_pre_hooks.values()
