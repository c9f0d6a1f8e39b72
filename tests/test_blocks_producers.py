"""Quantize in the producer (blocks/producers.py): the LayerNorms (config.fuse_norm, blocks/encoder_layer.py) and
the MLP activation (config.fuse_activation, blocks/mlp.py) writing the next op's 8-bit input, against the stock
LayerNorm / activation followed by the op's own quantize.

Numerics claimed (the speed issue's criterion: fused paths equal to the unfused ones within the unfused path's
own error): the LayerNorm's output and its 8-bit form are those of the stock LayerNorm -> quantize_rowwise
pipeline up to float32 summation order (kernels: tests/test_norm_quant.py); such a difference may move a value
across an 8-bit rounding boundary, and a tiny model shows that one step. So the fused model's logits and every
gradient must lie no farther from the unfused SwitchBack model's than the unfused model lies from the exact
16-bit one (norms over each tensor; plus 1e-6 of the exact tensor's norm, for gradients near zero). The bias of
k_proj is left out: its exact gradient is zero (softmax ignores a shift shared by all keys), what remains is
float32 rounding noise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_pair_inputs, tiny_pair_model
from torch import nn

from hf_switchback import SwitchBackConfig, apply_switchback, remove_switchback
from hf_switchback.blocks.encoder_layer import is_fused_layer
from hf_switchback.blocks.producers import layernorm_quantize, quantize_rows
from hf_switchback.functional import switchback_linear
from hf_switchback.kernels import reference

TORCH = SwitchBackConfig(backend="torch", min_tokens=0)
# Every op quantizes its own input: the baseline the producers are compared with
STOCK = TORCH.replace(fuse_norm=False, fuse_activation=False)
# The four ways the blocks after the two LayerNorms run: separate layers, one q/k/v op, one MLP op, both
# (memory_efficient fuses the MLP and saves 8-bit inputs).
BLOCK_MODES = [{}, {"fuse_qkv": True}, {"fuse_mlp": True}, {"fuse_qkv": True, "memory_efficient": True}]
# Every producer fused, on the GPU: the LayerNorms and the activation (separate MLP layers)
ALL_PRODUCERS = {"fuse_qkv": True, "fuse_activation": True}


def loss_and_grads(model: nn.Module, device: str = "cpu", autocast: bool = False):
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        out = model(**tiny_pair_inputs(device=device), return_loss=True)
    out.loss.backward()
    # (a compiled model's names carry the wrapper's prefix)
    return out.logits_per_image.float(), {
        n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters() if p.grad is not None
    }


def assert_within_own_error(got, want, exact, independent: bool = False):
    """got (fused) within the distance of want (unfused SwitchBack) from exact, tensor by tensor.

    independent: got's 8-bit rounding is not want's (on the GPU the Triton kernels sum in another order, so
    values move across rounding boundaries all over the model, and a tiny model's tensors then scatter: one
    tensor's error may double by chance, as the q / k gradients of one seed did). Then got must be as accurate
    as want over the whole model: its mean relative error over the gradients of 64 values or more at most 1.25
    times want's. Measured on an H200 over 8 seeds (fuse_activation, int8): 0.080 against the unfused 0.084,
    per seed at most 1.15 times."""
    assert got[1].keys() == want[1].keys() == exact[1].keys()
    names = [name for name in want[1] if not name.endswith("k_proj.bias")]
    if independent:

        def mean_error(grads):
            errors = [
                ((grads[n].double() - exact[1][n].double()).norm() / exact[1][n].double().norm()).item()
                for n in names
                if exact[1][n].numel() >= 64
            ]
            return sum(errors) / len(errors)

        assert mean_error(got[1]) <= 1.25 * mean_error(want[1]), (mean_error(got[1]), mean_error(want[1]))
        return
    pairs = [("logits", got[0], want[0], exact[0])]
    pairs += [(name, got[1][name], want[1][name], exact[1][name]) for name in names]
    for name, g, w, e in pairs:
        g, w, e = g.double(), w.double(), e.double()
        allowed = (w - e).norm().item() + 1e-6 * e.norm().item()
        assert (g - w).norm().item() <= allowed, (name, (g - w).norm().item(), allowed)


def count_calls(monkeypatch, name: str = "layernorm_quantize_rowwise") -> list:
    """Records the input shape of every call of the reference kernel `name`."""
    calls = []
    twin = getattr(reference, name)

    def spy(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return twin(x, *args, **kwargs)

    monkeypatch.setattr(reference, name, spy)
    return calls


def fused_layers(model: nn.Module) -> int:
    return sum(is_fused_layer(m) for m in model.modules())


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize("modes", BLOCK_MODES)
def test_fused_norms_train_like_the_stock_layernorm(kind, modes, monkeypatch):
    base = tiny_pair_model(kind)
    exact = loss_and_grads(copy.deepcopy(base))
    want = loss_and_grads(apply_switchback(copy.deepcopy(base), STOCK.replace(**modes)))
    model = apply_switchback(copy.deepcopy(base), STOCK.replace(fuse_norm=True, **modes))
    layers = 4  # two per tower
    assert fused_layers(model) == layers
    calls = count_calls(monkeypatch)
    assert_within_own_error(loss_and_grads(model), want, exact)
    # both LayerNorms of every layer wrote the 8-bit input (without fuse_qkv, for the three q/k/v layers)
    assert len(calls) == 2 * layers


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize("fuse_qkv", [True, False])
def test_fused_norms_under_autocast_quantize_the_rounded_output(kind, fuse_qkv, monkeypatch):
    """Under bf16 autocast the stock LayerNorm runs in float32 and the linear casts its output to bfloat16: the
    fused LayerNorm writes that bfloat16 rounding and quantizes it."""
    base = tiny_pair_model(kind)
    exact = loss_and_grads(copy.deepcopy(base), autocast=True)
    cfg = STOCK.replace(fuse_qkv=fuse_qkv)
    want = loss_and_grads(apply_switchback(copy.deepcopy(base), cfg), autocast=True)
    model = apply_switchback(copy.deepcopy(base), cfg.replace(fuse_norm=True))
    calls = count_calls(monkeypatch)
    assert_within_own_error(loss_and_grads(model, autocast=True), want, exact)
    assert len(calls) == 8


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize("with_norm", [False, True])
def test_fused_activation_trains_like_the_stock_mlp(kind, with_norm, monkeypatch):
    """CLIP's quick_gelu, SigLIP's tanh GELU: the activation writes fc2's 8-bit input (and the LayerNorm fc1's)."""
    base = tiny_pair_model(kind)
    exact = loss_and_grads(copy.deepcopy(base))
    want = loss_and_grads(apply_switchback(copy.deepcopy(base), STOCK))
    model = apply_switchback(copy.deepcopy(base), STOCK.replace(fuse_activation=True, fuse_norm=with_norm))
    activations, norms = count_calls(monkeypatch, "act_and_quantize_rowwise"), count_calls(monkeypatch)
    backwards = count_calls(monkeypatch, "act_backward_quantize_colsum")
    assert_within_own_error(loss_and_grads(model), want, exact)
    # one MLP (and both LayerNorms) a layer; fc1's output gradient quantized in the activation's backward
    assert len(activations) == len(backwards) == 4 and len(norms) == (8 if with_norm else 0)
    assert fused_layers(model) == (4 if with_norm else 0)


def test_an_activation_the_kernels_lack_runs_as_its_module(monkeypatch):
    base = tiny_pair_model("clip")
    base.vision_model.encoder.layers[0].mlp.activation_fn = nn.ReLU()  # before conversion
    model = apply_switchback(copy.deepcopy(base), STOCK.replace(fuse_activation=True))
    model.text_model.encoder.layers[1].mlp.activation_fn = nn.SiLU()  # after: not the type it was fused with
    want_model = apply_switchback(copy.deepcopy(base), STOCK)
    want_model.text_model.encoder.layers[1].mlp.activation_fn = nn.SiLU()
    want = loss_and_grads(want_model)
    calls = count_calls(monkeypatch, "act_and_quantize_rowwise")
    logits, grads = loss_and_grads(model)
    assert len(calls) == 2  # the two MLPs whose activation is still the fused kind
    assert_within_own_error((logits, grads), want, loss_and_grads(copy.deepcopy(base)))


def test_state_dict_remove_and_reapply_keep_the_model(tmp_path):
    base = tiny_pair_model("clip")
    model = apply_switchback(copy.deepcopy(base), TORCH.replace(fuse_qkv=True))  # the producers on by default
    assert list(model.state_dict()) == list(base.state_dict())
    encoder_layer = model.text_model.encoder.layers[0]
    assert type(encoder_layer).__name__ == "SwitchBackNormCLIPEncoderLayer"
    assert isinstance(encoder_layer, type(base.text_model.encoder.layers[0]))
    remove_switchback(model)
    assert fused_layers(model) == 0
    assert {type(m) for m in model.modules()} == {type(m) for m in base.modules()}
    # a config without fuse_norm gives the layers their class back
    apply_switchback(model, TORCH)
    assert fused_layers(model) == 4
    apply_switchback(model, STOCK)
    assert fused_layers(model) == 0


def test_layers_without_a_qualifying_block_stay_stock():
    """Only the MLPs converted: the layers fuse LayerNorm 2 only; nothing converted: nothing fuses."""
    base = tiny_pair_model("clip")
    only_mlp = TORCH.replace(target_modules=r".*\.mlp\.fc[12]")
    model = apply_switchback(copy.deepcopy(base), only_mlp)
    assert fused_layers(model) == 4
    want = loss_and_grads(
        apply_switchback(copy.deepcopy(base), only_mlp.replace(fuse_norm=False, fuse_activation=False))
    )
    assert_within_own_error(loss_and_grads(model), want, loss_and_grads(copy.deepcopy(base)))
    none = apply_switchback(copy.deepcopy(base), TORCH.replace(target_modules=r".*\.out_proj"))
    assert fused_layers(none) == 0


def test_below_the_token_floor_the_stock_layernorm_runs(monkeypatch):
    base = tiny_pair_model("clip")
    floor = 10**6
    want = loss_and_grads(apply_switchback(copy.deepcopy(base), STOCK.replace(min_tokens=floor)))
    model = apply_switchback(copy.deepcopy(base), TORCH.replace(min_tokens=floor))
    calls = count_calls(monkeypatch)
    logits, grads = loss_and_grads(model)
    assert torch.equal(logits, want[0]) and all(torch.equal(g, want[1][n]) for n, g in grads.items())
    assert calls == []


def test_a_hooked_or_replaced_layernorm_runs_as_a_module(monkeypatch):
    model = apply_switchback(tiny_pair_model("clip"), TORCH.replace(fuse_qkv=True))
    layer = model.vision_model.encoder.layers[0]
    seen = []
    layer.layer_norm1.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    layer.layer_norm2 = nn.Sequential(layer.layer_norm2)  # not a plain LayerNorm any more
    calls = count_calls(monkeypatch)
    loss_and_grads(model)
    assert len(seen) == 1 and len(calls) == 8 - 2


def test_layernorm_before_three_projections_sums_their_gradients_in_its_input_dtype():
    """outputs=3 (q, k, v each read a view): the three 16-bit gradients are summed in x's float32, as the stock
    autocast graph sums them after each linear's cast, and LayerNorm's backward runs on that sum."""
    norm = nn.LayerNorm(64)
    nn.init.normal_(norm.weight)
    x = torch.randn(6, 64, requires_grad=True)
    grads = [torch.randn(6, 64).bfloat16() for _ in range(3)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys, (q, scale) = layernorm_quantize(x, norm, TORCH, outputs=3)
    assert len(ys) == 3 and all(y.dtype == torch.bfloat16 for y in ys)
    assert q.shape == (6, 64) and scale.shape == (6,)
    torch.autograd.backward(ys, grads)
    got = (x.grad, norm.weight.grad, norm.bias.grad)
    x.grad = norm.weight.grad = norm.bias.grad = None
    torch.nn.functional.layer_norm(x, (64,), norm.weight, norm.bias, norm.eps).backward(
        sum(g.float() for g in grads)
    )
    for g, w in zip(got, (x.grad, norm.weight.grad, norm.bias.grad), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layer_leaves", [True, False])
@pytest.mark.parametrize("fuse_qkv", [False, True])
def test_out_proj_takes_its_input_from_the_quantize_kernel(fuse_qkv, layer_leaves, monkeypatch):
    """With fuse_norm, every attention block's out_proj runs on quantize_rows' 8-bit form of the attention
    output (our one-pass kernel under torch.compile too), with or without fuse_qkv, through the layer's leaves
    (blocks/layer_leaves.py) or the attention block's forward."""
    from hf_switchback.blocks import attention
    from hf_switchback.blocks import layer_leaves as leaves

    monkeypatch.setattr(leaves, "ENABLED", layer_leaves)
    seen = {"attention": 0, "layer_leaves": 0}

    def spy(module):
        def counted(x, cfg):
            seen[module.__name__.rpartition(".")[2]] += 1
            return quantize_rows(x, cfg)

        monkeypatch.setattr(module, "quantize_rows", counted)

    spy(attention)
    spy(leaves)
    model = apply_switchback(tiny_pair_model("clip"), TORCH.replace(fuse_qkv=fuse_qkv))
    loss_and_grads(model)
    assert seen == (
        {"attention": 0, "layer_leaves": 4} if layer_leaves else {"attention": 4, "layer_leaves": 0}
    )


@pytest.mark.parametrize("layer_leaves", [True, False])
@pytest.mark.parametrize("modes", BLOCK_MODES)
def test_each_block_is_checked_once_per_layer_forward(modes, layer_leaves, monkeypatch):
    """The encoder layer hands each block the config its own check just found (`checked_config`): torch.compile's
    Dynamo interprets every such check at each trace, every process, so the block does not repeat it. Where the
    layer takes its two leaves (blocks/layer_leaves.py), the layer's one flat check replaces the blocks'."""
    from hf_switchback.blocks import attention, mlp
    from hf_switchback.blocks import layer_leaves as leaves

    monkeypatch.setattr(leaves, "ENABLED", layer_leaves)
    model = apply_switchback(tiny_pair_model("clip"), TORCH.replace(**modes))
    assert fused_layers(model) == 4
    checks = {"attention": 0, "mlp": 0}

    def counted(name, check):
        def wrapped(module):
            checks[name] += 1
            return check(module)

        return wrapped

    monkeypatch.setattr(attention, "_fusable", counted("attention", attention._fusable))
    monkeypatch.setattr(mlp, "_fused_config", counted("mlp", mlp._fused_config))
    loss_and_grads(model)
    # one per block (2 towers x 2 layers) on the block path, none through the leaves
    per_block = 0 if layer_leaves else 4
    assert checks == {"attention": per_block, "mlp": per_block}


@pytest.mark.parametrize("fuse_qkv", [True, False])
def test_compiled_fused_layer_has_no_graph_break(fuse_qkv):
    model = apply_switchback(tiny_pair_model("clip"), TORCH.replace(fuse_qkv=fuse_qkv))
    layer = model.vision_model.encoder.layers[0]
    h = torch.randn(3, 5, 64, requires_grad=True)
    want = layer(h, None)
    want.square().sum().backward()
    want_grad, h.grad = h.grad, None
    torch._dynamo.reset()
    got = torch.compile(layer, backend="aot_eager", fullgraph=True)(h, None)
    got.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(h.grad, want_grad, rtol=1e-5, atol=1e-6)


def test_config_fields_and_bad_quantized_input():
    for name in ("fuse_norm", "fuse_activation"):
        assert getattr(SwitchBackConfig(), name)  # on by default: measured faster (BENCHMARKS.md)
        assert not getattr(SwitchBackConfig.from_dict(TORCH.replace(**{name: False}).to_dict()), name)
        with pytest.raises(TypeError, match=name):
            SwitchBackConfig(**{name: "yes"})
    x, w = torch.randn(6, 8), torch.randn(4, 8)
    q, scale = reference.quantize_rowwise(x)
    torch.testing.assert_close(
        switchback_linear(x, w, None, TORCH, quantized_input=(q, scale)), switchback_linear(x, w, None, TORCH)
    )
    with pytest.raises(ValueError, match="quantized_input must be x's row-wise 8-bit form"):
        switchback_linear(x, w, None, TORCH, quantized_input=(q[:3], scale[:3]))
    with pytest.raises(ValueError, match="quantized_input"):
        switchback_linear(x, w, None, TORCH.replace(precision="fp8"), quantized_input=(q, scale))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("modes", [*BLOCK_MODES, ALL_PRODUCERS])
def test_gpu_fused_norms_match_the_stock_layernorm(precision, modes):
    """The Triton kernels, bf16 autocast: as accurate as the unfused path (see assert_within_own_error)."""
    base = tiny_pair_model("clip").cuda()
    exact = loss_and_grads(
        copy.deepcopy(base), "cuda"
    )  # float32: shares no bfloat16 rounding with either side
    cfg = SwitchBackConfig(min_tokens=0, precision=precision, **modes)
    stock = cfg.replace(fuse_norm=False, fuse_activation=False)
    want = loss_and_grads(apply_switchback(copy.deepcopy(base), stock), "cuda", autocast=True)
    model = apply_switchback(copy.deepcopy(base), cfg)
    assert fused_layers(model) == 4
    assert_within_own_error(loss_and_grads(model, "cuda", autocast=True), want, exact, independent=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fuse_qkv", [True, False])
def test_gpu_compiled_fused_norms_match_eager(fuse_qkv):
    """Whole model compiled (Inductor: traced kernels, the three-output LayerNorm op without fuse_qkv)."""
    base = tiny_pair_model("clip").cuda()
    exact = loss_and_grads(copy.deepcopy(base), "cuda")
    cfg = SwitchBackConfig(min_tokens=0, fuse_norm=True, fuse_activation=True, fuse_qkv=fuse_qkv)
    want = loss_and_grads(apply_switchback(copy.deepcopy(base), cfg), "cuda", autocast=True)
    model = apply_switchback(copy.deepcopy(base), cfg)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    assert_within_own_error(loss_and_grads(compiled, "cuda", autocast=True), want, exact, independent=True)
