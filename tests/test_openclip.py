"""OpenCLIP users: the bitsandbytes drop-in (bnb_compat) and SwitchBack on nn.MultiheadAttention.

CPU tests build OpenCLIP-shaped blocks from torch modules only and call the layers the way OpenCLIP does
(open_clip.utils.replace_linear / convert_int8_model_to_inference_mode). Tests marked "needs open_clip" run on
a real open_clip ViT-B-32 and skip where open_clip is not importable (it needs torchvision, which does not load
beside the CPU torch build).
"""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, snr_db
from torch import nn

from hf_switchback import SwitchBackConfig, apply_switchback, bnb_compat, remove_switchback
from hf_switchback.blocks import SwitchBackMultiheadAttention
from hf_switchback.blocks import multihead_attention as mha_module
from hf_switchback.blocks.multihead_attention import convert_multihead_attention

OPENCLIP_TARGETS = ["c_fc", "c_proj", "attn"]
TORCH = SwitchBackConfig(backend="torch", target_modules=OPENCLIP_TARGETS)
# Measured on the torch reference path against float64 over 4 seeds: int8 >= 34.6 dB on outputs and
# gradients of these blocks; the floors leave a few dB for other seeds.
SNR_FLOOR = 30.0


class ResidualAttentionBlock(nn.Module):
    """OpenCLIP's block (LayerNorm -> nn.MultiheadAttention, LayerNorm -> c_fc -> GELU -> c_proj), torch only."""

    def __init__(self, width: int = 64, heads: int = 4, batch_first: bool = True) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=batch_first)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(
                [
                    ("c_fc", nn.Linear(width, 4 * width)),
                    ("gelu", nn.GELU()),
                    ("c_proj", nn.Linear(4 * width, width)),
                ]
            )
        )

    def forward(self, x, attn_mask=None, key_padding_mask=None):
        y = self.ln_1(x)
        x = (
            x
            + self.attn(y, y, y, need_weights=False, attn_mask=attn_mask, key_padding_mask=key_padding_mask)[
                0
            ]
        )
        return x + self.mlp(self.ln_2(x))


def replace_linear_like_openclip(model: nn.Module, cls, names=("c_fc", "c_proj")) -> nn.Module:
    """What open_clip.utils.replace_linear does: recurse over children, build `cls(in, out, has_bias)` for each
    named nn.Linear (positional arguments, default device and dtype) and copy the weights into it."""
    for name, child in model.named_children():
        replace_linear_like_openclip(child, cls, names)
        if isinstance(child, nn.Linear) and name in names:
            new = cls(child.in_features, child.out_features, child.bias is not None)
            new.weight.data.copy_(child.weight.data)
            if new.bias is not None:
                new.bias.data.copy_(child.bias.data)
            model._modules[name] = new
    return model


def convert_int8_like_openclip(model: nn.Module) -> None:
    """open_clip.utils.convert_int8_model_to_inference_mode's loop."""
    for m in model.modules():
        if hasattr(m, "prepare_for_eval"):
            dtype = m.weight.dtype
            m.prepare_for_eval()
            m.int8_original_dtype = dtype


def run(model: nn.Module, x: torch.Tensor, g: torch.Tensor, **kwargs) -> dict[str, torch.Tensor]:
    """Output, input gradient and every parameter gradient of sum(model(x, **kwargs) * g), by name."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x, **kwargs)
    (out * g).sum().backward()
    grads = {f"grad.{n}": p.grad for n, p in model.named_parameters()}
    return {"out": out.detach(), "grad.x": x.grad, **grads}


def assert_close_snr(exact: dict, got: dict, floor: float = SNR_FLOOR) -> None:
    assert exact.keys() == got.keys()
    for name, e in exact.items():
        assert got[name] is not None and got[name].shape == e.shape, name
        assert snr_db(e, got[name]) > floor, (name, snr_db(e, got[name]))


# ---------------------------------------------------------------- the bitsandbytes drop-in


@pytest.mark.parametrize(
    "cls, scaling, mem_efficient",
    [
        (bnb_compat.SwitchBackLinearGlobal, "tensor", False),
        (bnb_compat.SwitchBackLinearVectorwise, "row", False),
        (bnb_compat.SwitchBackLinearGlobalMemEfficient, "tensor", True),
        (bnb_compat.SwitchBackLinear, "tensor", False),
    ],
)
def test_bnb_classes_built_and_called_as_openclip_does(cls, scaling, mem_efficient):
    plain = ResidualAttentionBlock()
    model = replace_linear_like_openclip(copy.deepcopy(plain), cls)
    for layer in (model.mlp.c_fc, model.mlp.c_proj):
        assert type(layer) is cls and isinstance(layer, nn.Linear)
        cfg = layer.switchback_config
        # 8-bit at every batch size, as bitsandbytes was
        assert (cfg.weight_scaling, cfg.memory_efficient, cfg.min_tokens) == (scaling, mem_efficient, 0)
        assert layer.vector_wise_quantization == (scaling == "row")
    assert model.state_dict().keys() == plain.state_dict().keys()
    x, g = torch.randn(3, 9, 64), torch.randn(3, 9, 64)
    assert_close_snr(run(copy.deepcopy(plain).double(), x.double(), g.double()), run(model, x, g))

    # OpenCLIP's eval-only path: prepare_for_eval on every layer that has it, then no-grad forwards.
    model.eval()
    with torch.no_grad():
        before = model(x)
    convert_int8_like_openclip(model)
    assert model.mlp.c_fc.int8_original_dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0, atol=0)  # same 8-bit weight, cached
    model.train()
    assert_close_snr(run(copy.deepcopy(plain).double(), x.double(), g.double()), run(model, x, g))


def test_bnb_constructor_arguments():
    layer = bnb_compat.SwitchBackLinear(16, 8, False, "meta", torch.bfloat16, True, True)
    assert layer.bias is None and layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert layer.switchback_config.weight_scaling == "row" and layer.switchback_config.memory_efficient
    layer = bnb_compat.SwitchBackLinearGlobal(16, 8, bias=True, dtype=torch.float16)
    assert layer.weight.shape == (8, 16) and layer.bias.dtype == torch.float16
    # The inherited from_linear works on the drop-in classes too (config wins over the class's flags).
    linear = nn.Linear(16, 8)
    layer = bnb_compat.SwitchBackLinearVectorwise.from_linear(linear)
    assert layer.weight is linear.weight and layer.switchback_config == bnb_compat.bnb_config(True)
    with pytest.raises(TypeError):
        bnb_compat.SwitchBackLinearGlobal(16, 8, True, None, None, True)  # the flags are fixed per class


# ---------------------------------------------------------------- nn.MultiheadAttention


def _masks(kind: str, n: int, length: int, heads: int):
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    if kind == "none":
        return {}
    if kind == "float_causal":  # OpenCLIP's text tower
        return {"attn_mask": torch.zeros(length, length).masked_fill(causal, float("-inf"))}
    if kind == "bool_causal":
        return {"attn_mask": causal}
    if kind == "padding":
        pad = torch.zeros(n, length, dtype=torch.bool)
        pad[0, -3:] = True
        return {"key_padding_mask": pad}
    if kind == "3d_and_padding":
        pad = torch.zeros(n, length)
        pad[1, -2:] = float("-inf")  # float, like the attn_mask (mixed mask types are deprecated in torch)
        return {"attn_mask": torch.randn(n * heads, length, length), "key_padding_mask": pad}
    raise AssertionError(kind)


@pytest.mark.parametrize("masks", ["none", "float_causal", "bool_causal", "padding", "3d_and_padding"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_matches_stock_module(batch_first, masks):
    plain = ResidualAttentionBlock(batch_first=batch_first)
    model = apply_switchback(copy.deepcopy(plain), TORCH)
    assert type(model.attn) is SwitchBackMultiheadAttention and isinstance(model.attn, nn.MultiheadAttention)
    n, length = 3, 11
    x, g = torch.randn(n, length, 64), torch.randn(n, length, 64)
    if not batch_first:
        x, g = x.transpose(0, 1), g.transpose(0, 1)
    kwargs = _masks(masks, n, length, heads=4)
    exact = run(
        copy.deepcopy(plain).double(),
        x.double(),
        g.double(),
        **{k: v.double() if v.is_floating_point() else v for k, v in kwargs.items()},
    )
    assert_close_snr(exact, run(model, x, g, **kwargs))


def test_multihead_attention_one_packed_gemm_and_same_parameters(monkeypatch):
    plain = ResidualAttentionBlock()
    params = dict(plain.named_parameters())
    model = apply_switchback(plain, TORCH)
    assert model is plain and {n: p for n, p in model.named_parameters()} == params  # same objects
    assert list(model.attn.state_dict()) == [
        "in_proj_weight",
        "in_proj_bias",
        "out_proj.weight",
        "out_proj.bias",
    ]
    shapes = []
    real = mha_module.switchback_linear

    def spy(x, weight, bias, config):
        shapes.append(tuple(weight.shape))
        assert config is TORCH
        return real(x, weight, bias, config)

    monkeypatch.setattr(mha_module, "switchback_linear", spy)
    model(torch.randn(2, 5, 64))
    assert shapes == [(192, 64), (64, 64)]  # q, k, v in one N = 3d GEMM, then out_proj


def test_remove_restores_and_checkpoints_load_in_stock_module():
    plain = ResidualAttentionBlock(batch_first=False)
    reference = copy.deepcopy(plain)
    model = apply_switchback(plain, TORCH)
    state = model.state_dict()
    fresh = ResidualAttentionBlock(batch_first=False)
    fresh.load_state_dict(state)  # strict: the keys of a stock block
    x = torch.randn(7, 2, 64)
    torch.testing.assert_close(fresh(x), reference(x))
    remove_switchback(model)
    assert type(model.attn) is nn.MultiheadAttention and not hasattr(model.attn, "switchback_config")
    assert type(model.mlp.c_fc) is nn.Linear
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_calls_that_do_not_qualify_run_stock_math(caplog):
    plain = ResidualAttentionBlock()
    model = apply_switchback(copy.deepcopy(plain), TORCH)
    x = torch.randn(2, 6, 64)
    with caplog.at_level(logging.WARNING, logger=mha_module.__name__):
        out, weights = model.attn(x, x, x, need_weights=True)
        ref_out, ref_weights = plain.attn(x, x, x, need_weights=True)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        torch.testing.assert_close(weights, ref_weights, rtol=0, atol=0)
        other = torch.randn(2, 6, 64)
        got, ref = (
            model.attn(x, other, other, need_weights=False)[0],
            plain.attn(x, other, other, need_weights=False)[0],
        )
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert "need_weights=True" in caplog.text and "not one tensor" in caplog.text


def test_attention_selection_and_unsupported_modules(caplog):
    # The CLIP / SigLIP defaults never name an attention module: OpenCLIP models need "attn" in the targets.
    model = apply_switchback(
        ResidualAttentionBlock(), SwitchBackConfig(backend="torch", target_modules=["c_fc"])
    )
    assert type(model.attn) is nn.MultiheadAttention
    # A narrower selection after a wider one is refused, as for linears; a new config reconfigures.
    apply_switchback(model, TORCH)
    with pytest.raises(ValueError, match="attention modules already use SwitchBack"):
        apply_switchback(model, TORCH.replace(target_modules=["c_fc", "c_proj"]))
    apply_switchback(model, TORCH.replace(weight_scaling="row"))
    assert model.attn.switchback_config.weight_scaling == "row"

    pooler = nn.ModuleDict(
        {"attn": nn.MultiheadAttention(64, 4, kdim=32, vdim=32), "c_fc": nn.Linear(64, 64)}
    )
    with caplog.at_level(logging.WARNING):
        apply_switchback(pooler, TORCH)
    assert type(pooler["attn"]) is nn.MultiheadAttention and "kdim / vdim" in caplog.text
    with pytest.raises(ValueError, match="add_bias_kv"):
        convert_multihead_attention(nn.MultiheadAttention(64, 4, add_bias_kv=True))
    with pytest.raises(TypeError, match="SwitchBackConfig"):
        convert_multihead_attention(nn.MultiheadAttention(64, 4), config="int8")
    direct = SwitchBackMultiheadAttention(64, 4, batch_first=True, config=TORCH)
    y = torch.randn(2, 3, 64)
    assert direct(y, y, y, need_weights=False)[0].shape == (2, 3, 64)


# ---------------------------------------------------------------- a real OpenCLIP model (needs open_clip)


@pytest.fixture(scope="module")
def open_clip():
    try:
        import open_clip
    except Exception as err:  # ImportError, or torchvision failing to load its ops beside this torch build
        pytest.skip(f"needs open_clip: {type(err).__name__}: {err}")
    return open_clip


def _openclip_batch(device, n: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 224, 224, generator=gen)
    texts = torch.randint(1, 49407, (n, 77), generator=gen)
    return images.to(device), texts.to(device)


def _logits(model, images, texts) -> torch.Tensor:
    image_features, text_features, logit_scale = model(images, texts)[:3]
    return logit_scale * image_features.float() @ text_features.float().t()


def _eval_logits(model, device) -> torch.Tensor:
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
        return _logits(model, *_openclip_batch(device, seed=100))


def _loss(model, images, texts) -> torch.Tensor:
    logits = _logits(model, images, texts)
    labels = torch.arange(len(logits), device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def _gradients(model, device) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the CLIP loss on one fixed batch (bf16 autocast on CUDA, fp32 on CPU)."""
    model.train()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
        loss = _loss(model, *_openclip_batch(device, seed=0))
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _train_losses(model, steps: int, device) -> list[float]:
    """The training loss on one fixed batch before each of `steps` AdamW steps, and after the last. (SGD from
    the random init diverges at any rate that moves the loss in a few steps: logit scale 1 / 0.07.)"""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = _openclip_batch(device, seed=0)
    model.train()
    losses = []
    for step in range(steps + 1):
        with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
            loss = _loss(model, *batch)
        losses.append(loss.item())
        if step < steps:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return losses


def test_openclip_vit_b32_trains_with_dropin_and_with_apply_switchback(open_clip):
    from open_clip.utils import convert_int8_model_to_inference_mode, replace_linear

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stock = open_clip.create_model("ViT-B-32")  # random init, no download
    keys = stock.state_dict().keys()
    dropin = replace_linear(copy.deepcopy(stock), bnb_compat.SwitchBackLinearGlobal).to(device)
    converted = apply_switchback(
        copy.deepcopy(stock).to(device), SwitchBackConfig(target_modules=OPENCLIP_TARGETS, min_tokens=0)
    )
    blocks = list(converted.visual.transformer.resblocks) + list(converted.transformer.resblocks)
    assert all(type(b.attn) is SwitchBackMultiheadAttention for b in blocks)
    assert sum(isinstance(m, bnb_compat.SwitchBackLinear) for m in dropin.modules()) == 2 * len(blocks)

    stock = stock.to(device)
    ref_logits, ref_grads = _eval_logits(stock, device), _gradients(stock, device)
    ref_losses = _train_losses(stock, 3, device)
    assert ref_losses[-1] < ref_losses[0]
    for name, model in (("drop-in", dropin), ("apply_switchback", converted)):
        # Held-out logits at init against the stock model: 24 layers of 8-bit noise. A wrong head layout or mask
        # gives ~0 dB.
        assert snr_db(ref_logits, _eval_logits(model, device)) > 15, name
        # Each parameter's gradient on one batch against the stock model's: measured on the H100 (fp8 output
        # gradients) worst 12.8 dB (a last-layer LayerNorm bias), median 18.7 dB with every linear and the
        # attention swapped; the gradients of a wrong backward (a swapped q/k/v block, a dropped scale) are ~0 dB.
        grads = _gradients(model, device)
        assert grads.keys() == ref_grads.keys(), name
        worst = min((snr_db(ref_grads[p], grads[p]), p) for p in ref_grads)
        assert worst[0] > 8, (name, worst)
        # It learns: a few steps on one batch lower the loss, by at least half as much as for the stock model.
        losses = _train_losses(model, 3, device)
        assert losses[-1] < losses[0] - 0.5 * (ref_losses[0] - ref_losses[-1]), (name, losses, ref_losses)
        assert model.state_dict().keys() == keys, name
        fresh = open_clip.create_model("ViT-B-32")
        fresh.load_state_dict(model.state_dict())  # strict: loads in stock OpenCLIP as is
    remove_switchback(converted)
    assert not any(type(b.attn) is SwitchBackMultiheadAttention for b in blocks)

    # OpenCLIP's eval-only path for the drop-in: prepare_for_eval through its own helper, same logits.
    expected = _eval_logits(dropin, device)
    convert_int8_model_to_inference_mode(dropin)
    assert dropin.transformer.resblocks[0].mlp.c_fc.int8_original_dtype == torch.float32
    # The cached 8-bit weight equals the one each forward quantized (bit for bit on the torch path).
    torch.testing.assert_close(
        _eval_logits(dropin, device), expected, rtol=1e-3, atol=1e-3 * expected.abs().max()
    )


# ---------------------------------------------------------------- benchmarks/bench_openclip.py


def test_bench_openclip_help_without_open_clip():
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_openclip.py"), "--help"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "--variants" in result.stdout, result.stderr


def test_bench_openclip_cpu_smoke(open_clip):
    script = REPO / "benchmarks" / "bench_openclip.py"
    args = ["--device", "cpu", "--model", "tiny", "--batch", "2", "--steps", "1", "--warmup", "0"]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["variant"] for r in rows] == ["bf16", "mlp", "all"] and all(r["step_ms"] > 0 for r in rows)
