"""Fused q/k/v (blocks/qkv.py, blocks/attention.py) against three separate SwitchBackLinear layers.

Numerics claimed: forward outputs and every 16-bit gradient (grad-weight, grad-bias) equal the separate layers'
(forward bit for bit on the reference kernels; grad-weight up to float32 summation order, one stacked GEMM
instead of three); grad-input differs only by the shared per-token gradient scale of the one (tokens, 3d)
operand, so it must stay within the separate layers' own 8-bit error of an exact float64 computation.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import snr_db, tiny_pair_inputs, tiny_pair_model
from torch import nn
from transformers import CLIPModel
from transformers.models.clip.modeling_clip import CLIPAttention
from transformers.models.siglip.modeling_siglip import SiglipAttention

from hf_switchback import SwitchBackConfig, SwitchBackLinear, apply_switchback, remove_switchback
from hf_switchback.blocks import is_fused_attention, switchback_qkv

# fuse_norm off: it fuses LayerNorm 1 only into fused q/k/v, which would make the two sides differ by more than q/k/v
TORCH = SwitchBackConfig(backend="torch", min_tokens=0, fuse_norm=False)
FUSED = TORCH.replace(fuse_qkv=True)
ATTENTION = (CLIPAttention, SiglipAttention)
# Allowed loss of grad-input SNR (dB) against float64 when q, k, v share one gradient scale per token. Measured
# on the reference path: 2.1 dB (39.1 -> 37.0) with the test's 7x spread of projection magnitudes, within 0.3 dB
# on tiny CLIP models, where the separate layers' int8 error itself is at ~30-40 dB.
SHARED_SCALE_DB = 3.0


def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    dtype = next(model.parameters()).dtype
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tiny_pair_inputs().items()}
    out = model(**batch, return_loss=True)
    out.loss.backward()
    return out.logits_per_image, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def fused_count(model: nn.Module) -> int:
    return sum(is_fused_attention(m) for m in model.modules())


def run_three(x, weights, biases, g, config):
    """Reference: three separate SwitchBackLinear calls; returns outputs and the grads of x, weights, biases."""
    x = x.detach().requires_grad_()
    params = [p.detach().requires_grad_() for p in (*weights, *biases)]
    layers = []
    for w, b in zip(params[:3], params[3:], strict=True):
        layer = SwitchBackLinear(w.shape[1], w.shape[0], config=config)
        layer.weight, layer.bias = nn.Parameter(w), nn.Parameter(b)
        layers.append(layer)
    outs = [layer(x) for layer in layers]
    torch.autograd.backward(outs, g)
    grads = [layer.weight.grad for layer in layers] + [layer.bias.grad for layer in layers]
    return outs, x.grad, grads


def run_fused(x, weights, biases, g, config):
    x = x.detach().requires_grad_()
    params = [p.detach().requires_grad_() for p in (*weights, *biases)]
    outs = switchback_qkv(x, tuple(params[:3]), tuple(params[3:]), config)
    torch.autograd.backward(outs, g)
    return outs, x.grad, [p.grad for p in params]


@pytest.mark.parametrize("weight_scaling", ["tensor", "row"])
@pytest.mark.parametrize("grad_precision", ["int8", "fp8"])
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("wgrad_precision", ["16bit", "fp8"])
def test_switchback_qkv_matches_three_layers(
    weight_scaling, grad_precision, memory_efficient, wgrad_precision
):
    cfg = FUSED.replace(
        weight_scaling=weight_scaling,
        grad_precision=grad_precision,
        memory_efficient=memory_efficient,
        wgrad_precision=wgrad_precision,
    )
    gen = torch.Generator().manual_seed(0)
    d = 48
    x = torch.randn(2, 40, d, generator=gen)
    # Projections of different magnitudes, so the three tensor-wise weight scales differ.
    weights = [torch.randn(d, d, generator=gen) * s / d**0.5 for s in (1.0, 0.3, 2.0)]
    biases = [torch.randn(d, generator=gen) for _ in range(3)]
    g = [torch.randn(2, 40, d, generator=gen) for _ in range(3)]

    outs3, dx3, grads3 = run_three(x, weights, biases, g, cfg)
    outs1, dx1, grads1 = run_fused(x, weights, biases, g, cfg)
    for a, b in zip(outs3, outs1, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(grads3, grads1, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    exact = sum(gi.double() @ w.double() for gi, w in zip(g, weights, strict=True))
    assert snr_db(exact, dx1) >= snr_db(exact, dx3) - SHARED_SCALE_DB
    assert snr_db(exact, dx1) > 15


def test_switchback_qkv_small_batches_and_errors():
    w = [torch.randn(8, 16) for _ in range(3)]
    b = [torch.randn(8) for _ in range(3)]
    x = torch.randn(3, 16)
    exact = switchback_qkv(x, tuple(w), tuple(b), FUSED.replace(min_tokens=64))
    for out, wi, bi in zip(exact, w, b, strict=True):
        torch.testing.assert_close(out, x @ wi.t() + bi)
    with pytest.raises(ValueError, match="all three"):
        switchback_qkv(x, tuple(w), (b[0], None, b[2]), FUSED)
    with pytest.raises(RuntimeError, match="in_features"):
        switchback_qkv(x, (w[0], w[1], torch.randn(8, 15)), tuple(b), FUSED)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_fused_model_matches_separate_layers(kind):
    plain = tiny_pair_model(kind)
    keys = list(plain.state_dict())
    separate = apply_switchback(copy.deepcopy(plain), TORCH)
    fused = apply_switchback(copy.deepcopy(plain), FUSED)
    assert fused_count(separate) == 0 and fused_count(fused) == 4
    assert list(fused.state_dict()) == keys
    assert all(isinstance(m, ATTENTION) for m in fused.modules() if is_fused_attention(m))

    _, exact = loss_and_grads(copy.deepcopy(plain).double())
    logits3, grads3 = loss_and_grads(separate)
    logits1, grads1 = loss_and_grads(fused)
    assert torch.equal(logits1, logits3)
    assert grads1.keys() == grads3.keys() == exact.keys()
    for name in exact:
        ref_snr = snr_db(exact[name], grads3[name])
        if ref_snr > 15:  # skip gradients that are themselves ~0 (e.g. key biases) or all noise
            assert snr_db(exact[name], grads1[name]) >= ref_snr - 3, name


def test_save_load_round_trip_and_remove(tmp_path):
    plain = tiny_pair_model("clip")
    plain.save_pretrained(tmp_path / "plain")
    loaded = CLIPModel.from_pretrained(tmp_path / "plain", quantization_config=FUSED)
    assert fused_count(loaded) == 4
    loaded.save_pretrained(tmp_path / "fused")
    again = CLIPModel.from_pretrained(tmp_path / "fused")
    assert again.config.quantization_config.fuse_qkv and fused_count(again) == 4
    with torch.no_grad():
        a, b = loaded(**tiny_pair_inputs()), again(**tiny_pair_inputs())
    assert torch.equal(a.logits_per_image, b.logits_per_image)

    remove_switchback(again)
    assert fused_count(again) == 0
    assert all(type(m) in ATTENTION for m in again.modules() if isinstance(m, ATTENTION))
    assert not any(isinstance(m, SwitchBackLinear) for m in again.modules())
    reference = CLIPModel.from_pretrained(tmp_path / "plain")
    with torch.no_grad():
        torch.testing.assert_close(
            again(**tiny_pair_inputs()).logits_per_image, reference(**tiny_pair_inputs()).logits_per_image
        )


def test_config_field_and_fallbacks():
    assert not SwitchBackConfig().fuse_qkv
    assert SwitchBackConfig.from_dict(FUSED.to_dict()) == FUSED
    with pytest.raises(TypeError, match="fuse_qkv"):
        SwitchBackConfig(fuse_qkv="yes")

    model = tiny_pair_model("clip")
    apply_switchback(model, FUSED.replace(exclude_modules=["v_proj"]))  # a projection left 16-bit
    assert fused_count(model) == 0
    remove_switchback(model)
    apply_switchback(model, FUSED)
    assert fused_count(model) == 4
    apply_switchback(model, TORCH)  # re-applying can switch fusion off again
    assert fused_count(model) == 0

    # Configs that differ after fusing: the forward takes the layer path (same result as the unfused model).
    apply_switchback(model, FUSED)
    attn = model.vision_model.encoder.layers[0].self_attn
    attn.k_proj.switchback_config = FUSED.replace(weight_scaling="row")
    x = torch.randn(2, 5, 64)
    expect = CLIPAttention.forward(attn, x)[0]
    assert type(attn) is not CLIPAttention and not is_fused_attention(attn)  # our class, the layer path
    assert torch.equal(attn(x)[0], expect)
    # A forward hook on a projection must run: the layer path again.
    attn.k_proj.switchback_config = FUSED
    calls = []
    handle = attn.q_proj.register_forward_hook(lambda *args: calls.append(1))
    attn(x)
    handle.remove()
    assert calls == [1]


def test_peft_lora_on_q_proj_falls_back():
    peft = pytest.importorskip("peft")
    model = apply_switchback(tiny_pair_model("clip"), FUSED)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    attn = lora.base_model.model.vision_model.encoder.layers[0].self_attn
    assert not isinstance(attn.q_proj, SwitchBackLinear)
    nn.init.normal_(attn.q_proj.lora_B["default"].weight)  # a LoRA that changes q
    x = torch.randn(2, 5, 64)
    expect = CLIPAttention.forward(attn, x)[0]
    assert torch.equal(attn(x)[0], expect)
    out = lora(**tiny_pair_inputs(), return_loss=True)
    out.loss.backward()
    assert attn.q_proj.lora_A["default"].weight.grad is not None


def test_torch_compile_smoke():
    model = apply_switchback(tiny_pair_model("clip"), FUSED)
    eager_logits, eager_grads = loss_and_grads(copy.deepcopy(model))
    compiled = copy.deepcopy(model)
    compiled.vision_model.encoder.layers[0].self_attn.compile(backend="aot_eager")
    logits, grads = loss_and_grads(compiled)
    torch.testing.assert_close(logits, eager_logits)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("weight_scaling", ["tensor", "row"])
def test_triton_fused_matches_separate_layers(precision, weight_scaling):
    cfg = SwitchBackConfig(backend="triton", min_tokens=0, precision=precision, weight_scaling=weight_scaling)
    gen = torch.Generator(device="cuda").manual_seed(0)
    d, m = 768, 4096
    x = torch.randn(m, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    weights = [torch.randn(d, d, device="cuda", generator=gen) * s / d**0.5 for s in (1.0, 0.3, 2.0)]
    biases = [torch.randn(d, device="cuda", generator=gen) for _ in range(3)]
    g = [torch.randn(m, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3)]
    outs3, dx3, grads3 = run_three(x, weights, biases, g, cfg)
    outs1, dx1, grads1 = run_fused(x, weights, biases, g, cfg.replace(fuse_qkv=True))
    for a, b in zip(outs3, outs1, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)  # one bf16 rounding of the same float32 value
        assert snr_db(a, b) > 45
    for a, b in zip(grads3, grads1, strict=True):
        assert snr_db(a, b) > 40  # bf16 grad-weight GEMMs, one stacked vs three
    exact = sum(gi.double() @ w.double() for gi, w in zip(g, weights, strict=True))
    assert snr_db(exact, dx1) >= snr_db(exact, dx3) - SHARED_SCALE_DB


def test_autocast_and_gradient_checkpointing_match_separate_layers():
    plain = tiny_pair_model("clip")
    separate = apply_switchback(copy.deepcopy(plain), TORCH)
    fused = apply_switchback(copy.deepcopy(plain), FUSED)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = separate(**tiny_pair_inputs()), fused(**tiny_pair_inputs())
    assert a.logits_per_image.dtype == b.logits_per_image.dtype
    assert torch.equal(a.logits_per_image, b.logits_per_image)

    fused.train()
    _, grads = loss_and_grads(fused)
    checkpointed = copy.deepcopy(fused)
    checkpointed.zero_grad(set_to_none=True)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, grads_ckpt = loss_and_grads(checkpointed)
    assert grads_ckpt.keys() == grads.keys()
    for name, grad in grads.items():  # the recomputed forward is bit-identical, so are the gradients
        assert torch.equal(grads_ckpt[name], grad), name
