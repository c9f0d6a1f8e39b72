"""Fused SwitchBack MLP (hf_switchback.blocks.mlp, functional.switchback_mlp) on the torch path.

Oracles: torch autograd of the activations in float64 (the hand-written derivatives), the same block run as
three separate ops (fuse_mlp=False: SwitchBack fc1, the HF activation module, SwitchBack fc2), and the plain
float64 CLIPMLP. In float32 the fused block computes exactly what the separate layers compute except for
float32 rounding of the activation formulas, so the two must agree to ~1e-6 relative; in the memory-efficient
variant the fused block's fc2 grad-weight is *more* accurate (it uses act(h) recomputed, the separate layers
an int8 copy), which is checked against the float64 oracle instead.
"""

import copy

import pytest
import torch
from helpers import snr_db, tiny_clip_config
from torch import nn
from transformers import CLIPModel, CLIPVisionConfig
from transformers.models.clip.modeling_clip import CLIPMLP

from hf_switchback import SwitchBackConfig, apply_switchback, remove_switchback
from hf_switchback.blocks.mlp import activation_kind, is_fused_mlp
from hf_switchback.functional import switchback_mlp
from hf_switchback.kernels import reference as ref
from hf_switchback.weight_operands import cached_tensors, refresh_weight_operands

HIDDEN_ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
TORCH = SwitchBackConfig(backend="torch", fuse_mlp=True)


def make_mlp(hidden_act: str, d: int = 48, inner: int = 200) -> CLIPMLP:
    return CLIPMLP(
        CLIPVisionConfig(hidden_size=d, intermediate_size=inner, hidden_act=hidden_act, num_attention_heads=4)
    )


def run(block: nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    xi = x.clone().requires_grad_(True)
    out = block(xi)
    out.backward(g)
    grads = [xi.grad, block.fc1.weight.grad, block.fc1.bias.grad, block.fc2.weight.grad, block.fc2.bias.grad]
    block.zero_grad(set_to_none=True)
    return [out, *grads]


@pytest.mark.parametrize("activation", ref.ACTIVATIONS)
def test_activation_twins_match_float64_autograd(activation):
    h = torch.linspace(-12, 12, 4001, dtype=torch.float64)
    hr = h.clone().requires_grad_(True)
    if activation == "quick_gelu":
        exact = hr * torch.sigmoid(1.702 * hr)
    else:
        exact = nn.functional.gelu(hr, approximate="tanh" if activation == "gelu_tanh" else "none")
    grad = torch.randn_like(h)
    (exact_grad,) = torch.autograd.grad(exact, hr, grad)
    got = ref.apply_activation(h.float(), activation)
    got_grad = ref.activation_backward(grad.float(), h.float(), activation)
    torch.testing.assert_close(got.double(), exact.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad.double(), exact_grad, rtol=1e-5, atol=1e-5)


def test_act_twins_compose_quantize_and_colsum():
    h = torch.randn(37, 70, dtype=torch.bfloat16) * 3
    g = torch.randn(37, 70, dtype=torch.bfloat16)
    q, s = ref.act_quantize_rowwise(h, torch.int8, "gelu")
    a = ref.apply_activation(h, "gelu")
    assert a.dtype == torch.bfloat16
    q_ref, s_ref = ref.quantize_rowwise(a, torch.int8)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    gh, act, q, s, colsum = ref.act_backward_quantize_colsum(g, h, torch.int8, "quick_gelu", True)
    assert gh.dtype == torch.bfloat16 and torch.equal(act, ref.apply_activation(h, "quick_gelu"))
    assert torch.equal(q, ref.quantize_rowwise(gh, torch.int8)[0])
    torch.testing.assert_close(colsum, gh.float().sum(0))
    assert ref.act_backward_quantize_colsum(g, h, torch.int8, "gelu", False)[1].numel() == 0
    with pytest.raises(ValueError, match="activation"):
        ref.apply_activation(h, "relu")


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("hidden_act", list(HIDDEN_ACTS))
@pytest.mark.parametrize("variant", ["int8/tensor", "int8/row", "fp8/row"])
def test_fused_block_matches_separate_layers_and_float64(variant, hidden_act, memory_efficient):
    precision, scaling = variant.split("/")
    cfg = SwitchBackConfig(
        backend="torch",
        precision=precision,
        weight_scaling=scaling,
        memory_efficient=memory_efficient,
        fuse_mlp=True,
    )
    plain = make_mlp(hidden_act)
    fused = apply_switchback(copy.deepcopy(plain), cfg)
    # the stock three ops: no producer writes an 8-bit input either
    stock = cfg.replace(fuse_mlp=False, fuse_norm=False, fuse_activation=False)
    separate = apply_switchback(copy.deepcopy(plain), stock)
    full = apply_switchback(copy.deepcopy(plain), stock.replace(memory_efficient=False))
    assert is_fused_mlp(fused) and not is_fused_mlp(separate) and type(separate) is CLIPMLP
    x, g = torch.randn(2, 41, 48), torch.randn(2, 41, 48)
    got, sep = run(fused, x, g), run(separate, x, g)
    exact = run(plain.double(), x.double(), g.double())
    names = ["out", "dx", "dw1", "db1", "dw2", "db2"]
    for name, a, b, e in zip(names, got, sep, exact, strict=True):
        assert a.shape == e.shape and a.dtype == torch.float32, name
        if name == "dw2" and memory_efficient:
            # memory-efficient separate layers get dW2 from an int8 act(h); the fused block from act(h)
            # itself (recomputed from the saved h), i.e. what the non-memory-efficient layers compute.
            b = run(full, x, g)[4]
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * b.abs().max().item(), msg=name)
        floor = 22.0 if precision == "fp8" else 33.0  # measured over 3 seeds: int8 >= 37.3 dB, fp8 >= 25.1 dB
        assert snr_db(e, a) > floor, (name, snr_db(e, a))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_block_16bit_inputs(dtype):
    plain = make_mlp("quick_gelu")
    fused = apply_switchback(copy.deepcopy(plain).to(dtype), TORCH)
    x, g = torch.randn(3, 17, 48), torch.randn(3, 17, 48)
    got = run(fused, x.to(dtype), g.to(dtype))
    exact = run(plain.double(), x.double(), g.double())
    for a, e in zip(got, exact, strict=True):
        assert a.dtype == dtype
        assert snr_db(e, a) > 30, snr_db(e, a)


def test_memory_saved_for_backward_drops_by_half():
    """bf16 block saves h and act(h) (2 x M x 4d x 2 bytes); fused saves h; memory-efficient only int8 x."""

    def saved_bytes(block, x):
        seen = {}
        refresh_weight_operands(block)  # the weights' cached 8-bit forms: held with the weights, not per step
        params = {p.untyped_storage().data_ptr() for p in (*block.parameters(), *cached_tensors(block))}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr != x.untyped_storage().data_ptr():
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x)
        return sum(seen.values())

    m, d, inner = 256, 64, 256
    plain = make_mlp("gelu_pytorch_tanh", d, inner).to(torch.bfloat16)
    x = torch.randn(m, d, dtype=torch.bfloat16, requires_grad=True)
    bf16 = saved_bytes(plain, x)
    assert bf16 == 2 * m * inner * 2
    fused = apply_switchback(copy.deepcopy(plain), TORCH)
    assert saved_bytes(fused, x) == m * inner * 2
    mem = apply_switchback(copy.deepcopy(plain), TORCH.replace(memory_efficient=True))
    # h (M, 4d) is recomputed in backward from the int8 x: only x's int8 form and its row scales stay
    assert saved_bytes(mem, x) == m * d + 4 * m
    assert saved_bytes(mem, x) <= 0.1 * bf16


def test_activation_kinds():
    from transformers.activations import ACT2FN

    for hidden_act, kind in {**HIDDEN_ACTS, "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}.items():
        assert activation_kind(ACT2FN[hidden_act]) == kind, hidden_act
    assert activation_kind(nn.GELU()) == "gelu" and activation_kind(nn.GELU("tanh")) == "gelu_tanh"
    assert activation_kind(nn.ReLU()) is None and activation_kind(ACT2FN["gelu_10"]) is None


def test_apply_and_remove_on_clip_model_keep_keys_and_load_into_plain_model():
    config = tiny_clip_config()
    model = CLIPModel(config)
    keys = list(model.state_dict())
    apply_switchback(model, TORCH)
    mlps = [m for m in model.modules() if isinstance(m, CLIPMLP)]
    assert len(mlps) == 4 and all(is_fused_mlp(m) for m in mlps)
    assert list(model.state_dict()) == keys
    plain = CLIPModel(config)
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(2, 64, (2, 7))
    pixels = torch.randn(2, 3, 16, 16)
    out = model(input_ids=ids, pixel_values=pixels, return_loss=True)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    remove_switchback(model)
    assert all(type(m) is CLIPMLP for m in model.modules() if isinstance(m, CLIPMLP))
    assert not any(hasattr(m, "_switchback_activation") for m in model.modules())


def test_fuse_mlp_config_field():
    assert SwitchBackConfig().fuse_mlp is None and not SwitchBackConfig().fuses_mlp
    # the memory switch fuses by default (the fused block saves the least); an explicit False wins
    assert SwitchBackConfig(memory_efficient=True).fuses_mlp
    assert not SwitchBackConfig(memory_efficient=True, fuse_mlp=False).fuses_mlp
    assert SwitchBackConfig.from_dict(SwitchBackConfig(memory_efficient=True).to_dict()).fuses_mlp
    model = apply_switchback(make_mlp("quick_gelu"), SwitchBackConfig(backend="torch", memory_efficient=True))
    assert is_fused_mlp(model)
    cfg = SwitchBackConfig(fuse_mlp=False, memory_efficient=True)
    assert SwitchBackConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(TypeError, match="fuse_mlp"):
        SwitchBackConfig(fuse_mlp="yes")
    model = CLIPModel(tiny_clip_config())
    apply_switchback(model, SwitchBackConfig(backend="torch"))  # separate layers by default
    assert not any(is_fused_mlp(m) for m in model.modules())
    apply_switchback(model, SwitchBackConfig(backend="torch", fuse_mlp=True))
    assert sum(is_fused_mlp(m) for m in model.modules()) == 4


def test_only_fully_converted_blocks_with_one_config_fuse():
    model = CLIPModel(tiny_clip_config())
    apply_switchback(model, TORCH.replace(exclude_modules=["fc2"]))
    assert not any(is_fused_mlp(m) for m in model.modules())
    apply_switchback(model, TORCH.replace(fuse_mlp=False))
    assert not any(is_fused_mlp(m) for m in model.modules())
    apply_switchback(model, TORCH)
    assert sum(is_fused_mlp(m) for m in model.modules()) == 4
    apply_switchback(model, TORCH.replace(fuse_mlp=False))  # re-applying can switch fusion off again
    assert not any(is_fused_mlp(m) for m in model.modules())
    # unsupported activation: the block stays three ops
    relu = make_mlp("relu")
    apply_switchback(relu, TORCH)
    assert not is_fused_mlp(relu)
    apply_switchback(relu, TORCH.replace(fuse_norm=False))  # nothing for our class to do: the stock class
    assert type(relu) is CLIPMLP


def test_fused_forward_falls_back_when_the_block_changes_after_fusing():
    block = apply_switchback(make_mlp("quick_gelu"), TORCH)
    x = torch.randn(5, 48)
    before = block(x)
    block.activation_fn = nn.ReLU()  # no longer what the kernels would compute
    expect = block.fc2(torch.relu(block.fc1(x)))
    assert torch.equal(block(x), expect) and not torch.equal(block(x), before)


def test_small_batches_below_min_tokens_are_exact():
    plain = make_mlp("gelu")
    fused = apply_switchback(copy.deepcopy(plain), TORCH.replace(min_tokens=64))
    x = torch.randn(3, 10, 48)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-6, atol=1e-6)
    assert fused(torch.randn(0, 48)).shape == (0, 48)


def test_switchback_mlp_argument_errors():
    w1, w2 = torch.randn(64, 16), torch.randn(16, 64)
    with pytest.raises(ValueError, match="activation"):
        switchback_mlp(torch.randn(4, 16), w1, None, w2, None, "relu", TORCH)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        switchback_mlp(torch.randn(4, 15), w1, None, w2, None, "gelu", TORCH)
    with pytest.raises(RuntimeError, match="fc2_weight"):
        switchback_mlp(torch.randn(4, 16), w1, None, torch.randn(16, 63), None, "gelu", TORCH)


def test_no_grad_input_and_frozen_fc1():
    block = apply_switchback(make_mlp("gelu"), TORCH)
    block.fc1.requires_grad_(False)
    x = torch.randn(8, 48)  # no grad
    block(x).sum().backward()
    assert block.fc1.weight.grad is None and block.fc2.weight.grad is not None
    assert block.fc2.bias.grad is not None


def test_torch_compile_traces_the_fused_block_without_graph_breaks():
    import torch._dynamo as dynamo

    block = apply_switchback(make_mlp("quick_gelu"), TORCH.replace(memory_efficient=True))
    x = torch.randn(32, 48, requires_grad=True)
    explanation = dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
