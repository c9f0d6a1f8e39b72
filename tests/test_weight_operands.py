"""Each weight quantized once per update (weight_operands.py, KernelOptions.cache_weight_operands): training with
the cached 8-bit weight operands equals training without them, step after step, however the weights change,
eager and compiled; layers that run 16-bit drop them; sharded weights never get them."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_pair_inputs, tiny_pair_model
from torch import nn

from hf_switchback import KernelOptions, SwitchBackConfig, apply_switchback, remove_switchback
from hf_switchback.functional import switchback_linear
from hf_switchback.weight_operands import OPERANDS, cached_tensors, operands_for, refresh_weight_operands

CACHED = KernelOptions(cache_weight_operands=True)
UNCACHED = KernelOptions()  # (the default)
TORCH = SwitchBackConfig(backend="torch", min_tokens=0, kernel_options=CACHED)
# The ways the encoder blocks take a weight's operands: separate layers (LayerNorm and activation producers),
# one q/k/v op, one MLP op (memory_efficient: fc1's forward form again in backward), no producers.
MODES = [{}, {"fuse_qkv": True}, {"fuse_mlp": True, "memory_efficient": True}, {"fuse_norm": False}]


class DataOnlySGD(torch.optim.Optimizer):
    """SGD that writes through `.data`, which bumps no version counter (as bitsandbytes' 8-bit optimizers,
    whose kernels write in place)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def train(model: nn.Module, steps: int, optimizer_class=torch.optim.SGD, step=None, lr: float = 0.5):
    """Per step: the loss and every parameter's gradient, after `steps` optimizer steps (lr 0.5: the weights
    move enough to change every quantized value)."""
    optimizer = optimizer_class(model.parameters(), lr=lr)
    history = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (step or (lambda m: m(**tiny_pair_inputs(), return_loss=True).loss))(model)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        history.append((loss.detach(), grads))
        optimizer.step()
    return history


def assert_same_training(got, want):
    for (loss, grads), (want_loss, want_grads) in zip(got, want, strict=True):
        torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
        assert grads.keys() == want_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], want_grads[name], rtol=0, atol=0, msg=name)


def pair(kind: str = "clip", **changes):
    """(the model with cached operands, the same model without), from one tiny model."""
    base = tiny_pair_model(kind)
    config = TORCH.replace(**changes)
    cached = apply_switchback(copy.deepcopy(base), config)
    uncached = apply_switchback(copy.deepcopy(base), config.replace(kernel_options=UNCACHED))
    return cached, uncached


@pytest.mark.parametrize("modes", MODES)
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_training_with_cached_operands_equals_training_without(kind, modes):
    cached, uncached = pair(kind, **modes)
    assert cached_tensors(uncached) == []
    assert_same_training(train(cached, 3), train(uncached, 3))
    layers = [m for m in cached.modules() if hasattr(m, OPERANDS)]
    assert layers and all(getattr(m, OPERANDS).state == "live" for m in layers)
    assert len(cached_tensors(cached)) == 4 * len(layers)  # every layer ran 8-bit: both forms kept


def test_an_optimizer_that_bumps_no_version_counter_still_refreshes_them():
    cached, uncached = pair()
    assert_same_training(train(cached, 3, DataOnlySGD), train(uncached, 3, DataOnlySGD))


def test_a_weight_written_in_place_or_replaced_refreshes_them():
    cached, uncached = pair()
    for model in (cached, uncached):
        model(**tiny_pair_inputs(), return_loss=True)
    q_proj = cached.vision_model.encoder.layers[0].self_attn.q_proj
    before = operands_for(q_proj)[0].clone()
    with torch.no_grad():
        for model in (cached, uncached):
            model.vision_model.encoder.layers[0].self_attn.q_proj.weight.mul_(-1)  # bumps the version
            model.text_model.encoder.layers[0].mlp.fc1.weight = nn.Parameter(
                model.text_model.encoder.layers[0].mlp.fc1.weight * 3
            )
    assert torch.equal(operands_for(q_proj)[0], -before)  # (a symmetric quantize: the sign flips exactly)
    assert_same_training(train(cached, 2), train(uncached, 2))


def test_a_layer_called_on_its_own_gets_current_operands():
    cached, uncached = pair()
    train(cached, 1)
    train(uncached, 1)  # one step each: the weights moved since the cached model's last refresh
    layer, plain = cached.vision_model.encoder.layers[1], uncached.vision_model.encoder.layers[1]
    h = torch.randn(2, 7, layer.mlp.fc2.in_features)
    torch.testing.assert_close(layer.mlp.fc2(h), plain.mlp.fc2(h), rtol=0, atol=0)
    x = torch.randn(2, 7, layer.mlp.fc2.out_features)
    torch.testing.assert_close(layer(x, None), plain(x, None), rtol=0, atol=0)


@pytest.mark.parametrize("modes", [{}, {"fuse_qkv": True, "fuse_mlp": True}])
def test_compiled_layers_take_them_and_train_as_eager(modes):
    """Each encoder layer compiled (the model itself eager, as train_clip's --torch_compile): the graphs take
    the operands from the encoders' eager refresh, and training matches eager training without them."""
    cached, uncached = pair(**modes)
    for model in (cached,):
        for encoder in (model.vision_model.encoder, model.text_model.encoder):
            for layer in encoder.layers:
                layer.compile(backend="aot_eager", fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    got, want = train(cached, 3), train(uncached, 3)
    for (loss, grads), (want_loss, want_grads) in zip(got, want, strict=True):
        # aot_eager decomposes the reference quantizes: the same formulas, float32 rounding of another order
        torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)
        for name in grads:
            torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-3, atol=1e-4, msg=name)
    layers = [m for m in cached.modules() if hasattr(m, OPERANDS)]
    assert all(getattr(m, OPERANDS).state == "live" for m in layers)


def test_a_whole_model_compiled_with_fullgraph_quantizes_in_its_graph():
    cached, uncached = pair()
    compiled = torch.compile(cached, backend="aot_eager", fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    got = train(compiled, 2)
    want = train(uncached, 2)
    for (loss, _), (want_loss, _) in zip(got, want, strict=True):
        torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)


def test_layers_that_run_16_bit_drop_them():
    base = tiny_pair_model("clip")
    model = apply_switchback(base, TORCH.replace(min_tokens=10**6))
    train(model, 1)
    assert len(cached_tensors(model)) > 0  # kept for the first forward, before any layer ran
    train(model, 1)
    assert cached_tensors(model) == []
    assert {getattr(m, OPERANDS).state for m in model.modules() if hasattr(m, OPERANDS)} == {"idle"}


def test_sharded_or_unmaterialized_weights_get_none():
    model = apply_switchback(tiny_pair_model("clip"), TORCH)
    layer = model.vision_model.encoder.layers[0].mlp.fc1
    layer.weight.ds_id = 7  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
    refresh_weight_operands(model)
    assert getattr(layer, OPERANDS).operands is None
    assert getattr(model.vision_model.encoder.layers[0].mlp.fc2, OPERANDS).operands is not None


def test_remove_and_the_option_off_leave_no_hooks_or_operands():
    model = apply_switchback(tiny_pair_model("clip"), TORCH)
    hooked = [m for m in model.modules() if m._forward_pre_hooks]
    assert model in hooked and model.vision_model.encoder in hooked
    assert model.vision_model.encoder.layers[0] in hooked
    remove_switchback(model)
    assert not any(m._forward_pre_hooks or m._forward_hooks or hasattr(m, OPERANDS) for m in model.modules())
    model = apply_switchback(model, TORCH.replace(kernel_options=UNCACHED))
    assert len(model.vision_model.encoder._forward_pre_hooks) == 1  # the fused layers' own (contiguous input)
    assert not any(hasattr(m, OPERANDS) or m._forward_hooks for m in model.modules())
    model(**tiny_pair_inputs(), return_loss=True)
    assert cached_tensors(model) == []


def test_a_copy_refreshes_its_own():
    model = apply_switchback(tiny_pair_model("clip"), TORCH)
    train(model, 1)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    twin(**tiny_pair_inputs(), return_loss=True)
    layer, twin_layer = (m.vision_model.encoder.layers[0].self_attn.k_proj for m in (model, twin))
    assert not torch.equal(operands_for(layer)[1], operands_for(twin_layer)[1])  # the scales halved in twin


def test_operands_of_another_layer_are_refused():
    model = apply_switchback(tiny_pair_model("clip"), TORCH)
    refresh_weight_operands(model)
    mlp = model.vision_model.encoder.layers[0].mlp
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="weight_operands hold"):
        switchback_linear(x, mlp.fc1.weight, None, TORCH, weight_operands=operands_for(mlp.fc2))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_gpu_training_with_cached_operands_equals_training_without(precision, compiled):
    """The Triton kernels, bf16 autocast, three SGD steps. Eager: the same kernels quantize each weight (replayed
    from a CUDA graph after the first steps), so bitwise equal. Each encoder layer compiled (Inductor): the
    uncached graphs quantize the weights with Inductor's code of the same formulas, the cached ones read our
    kernels' output, so equal up to float32 rounding order, which moves a few 8-bit values across a rounding
    boundary; over steps a tiny model amplifies those (8% on one gradient after three steps), so there the
    weights stay put (lr 0, each step still refreshes the operands: the optimizer stepped): every step equals
    the first bitwise, and the uncached model's within 1e-3 (loss) and 2% (each gradient's relative norm)."""
    base = tiny_pair_model("clip").cuda()
    config = SwitchBackConfig(min_tokens=0, precision=precision, kernel_options=CACHED)
    models = [
        apply_switchback(copy.deepcopy(base), c) for c in (config, config.replace(kernel_options=UNCACHED))
    ]
    if compiled:
        for model in models:
            for encoder in (model.vision_model.encoder, model.text_model.encoder):
                for layer in encoder.layers:
                    layer.compile(fullgraph=True, dynamic=False)
        torch._dynamo.reset()

    def step(model):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(**tiny_pair_inputs(device="cuda"), return_loss=True).loss

    got, want = (train(model, 3, step=step, lr=0.0 if compiled else 0.5) for model in models)
    # after the first steps the model's hook refreshes every layer as one captured CUDA graph
    assert models[0]._switchback_operands_scope.graph is not None
    if not compiled:
        assert_same_training(got, want)
        return
    assert_same_training(got, [got[0]] * len(got))
    loss, grads = got[0]
    want_loss, want_grads = want[0]
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=1e-5)
    for name in grads:
        assert relative_error(grads[name], want_grads[name]) < 0.02, name
    assert len(cached_tensors(models[0])) > 0


def test_frozen_weights_under_lora_are_quantized_once():
    """PEFT LoRA on the SwitchBack layers: the frozen base weights keep their operands across optimizer steps
    (quantized once), and training equals training without them."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "fc1"], init_lora_weights=False)
    adapted = []
    for model in pair():
        torch.manual_seed(0)  # the same adapter initialization on both
        adapted.append(peft.get_peft_model(model, lora))
    cached, uncached = adapted
    q_proj = cached.base_model.model.vision_model.encoder.layers[0].self_attn.q_proj.base_layer
    cached(**tiny_pair_inputs(), return_loss=True)
    first = operands_for(q_proj)
    assert_same_training(train(cached, 3), train(uncached, 3))
    assert all(a is b for a, b in zip(operands_for(q_proj), first, strict=True))  # never quantized again
