"""PEFT LoRA on a SwitchBack base (an 8-bit frozen base with 16/32-bit adapters, the QLoRA-like path): the
adapters train while the base stays put, save / load round-trips, and merging keeps the SwitchBack layers."""

import pytest
import torch
from helpers import tiny_clip_config
from transformers import CLIPModel

from hf_switchback import SwitchBackConfig, SwitchBackLinear, apply_switchback, switchback_modules

peft = pytest.importorskip("peft")

TORCH = SwitchBackConfig(backend="torch")
TARGETS = ["q_proj", "v_proj", "fc1"]


def base_model(seed=0):
    torch.manual_seed(seed)
    return apply_switchback(CLIPModel(tiny_clip_config()), TORCH)


def lora_model(seed=0):
    # init_lora_weights=False: B starts non-zero, so the adapters change the output from the first step
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    return peft.get_peft_model(base_model(seed), config)


def batch(n=8):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 64, (n, 7), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(n, 3, 16, 16, generator=g),
        "return_loss": True,
    }


def test_lora_trains_the_adapters_and_leaves_the_switchback_base_alone():
    model = lora_model()
    lora_layer = model.base_model.model.vision_model.encoder.layers[0].self_attn.q_proj
    assert isinstance(lora_layer.base_layer, SwitchBackLinear)  # the frozen base computes in 8 bits
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(
        "lora_" in n for n, p in model.named_parameters() if p.requires_grad
    )  # only the adapters train
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    data = batch()
    losses = []
    for _ in range(8):
        loss = model(**data).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # the same batch 8 times: the loss must fall (the adapters learn it)
    assert losses[-1] < 0.9 * losses[0], losses
    for name, param in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, base_before[name]), name


def test_adapters_save_and_load_round_trip(tmp_path):
    model = lora_model()
    model.save_pretrained(tmp_path)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved  # adapters only
    reloaded = peft.PeftModel.from_pretrained(base_model(), tmp_path)
    model.eval(), reloaded.eval()
    data = {k: v for k, v in batch().items() if k != "return_loss"}
    with torch.no_grad():
        expected, got = model(**data), reloaded(**data)
    # the same base weights and adapters through the same SwitchBack path: bit-identical
    assert torch.equal(expected.logits_per_image, got.logits_per_image)


def test_merge_and_unload_keeps_switchback_layers_with_the_merged_weight():
    model = lora_model()
    layer = model.base_model.model.text_model.encoder.layers[1].mlp.fc1
    scaling = layer.scaling["default"]
    expected = layer.base_layer.weight + scaling * (
        layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    )
    expected = expected.detach().clone()
    swapped_before = {n.removesuffix(".base_layer") for n in switchback_modules(model.base_model.model)}
    merged = model.merge_and_unload()
    merged_fc1 = merged.text_model.encoder.layers[1].mlp.fc1
    assert isinstance(merged_fc1, SwitchBackLinear) and merged_fc1.switchback_config == TORCH
    assert set(switchback_modules(merged)) == swapped_before
    # W + scaling * B A in float32: only rounding of the sum
    torch.testing.assert_close(merged_fc1.weight, expected, rtol=0, atol=1e-6)
