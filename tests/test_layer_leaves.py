"""A fused encoder layer with every part 8-bit as two graph leaves (blocks/layer_leaves.py), against the block
path it replaces (the attention block's and the MLP's forwards, HF_SWITCHBACK_LAYER_LEAVES=0).

The leaves call the same ops in the same order as the blocks, so the claim is bitwise: logits and every gradient
equal (torch.equal), eager and under torch.compile (aot_eager: the graph AOT autograd traces, run op by op), for
each way the blocks run (separate q/k/v or one op; MLP as fc1 + activation feeding fc2 or as one op), int8 and
fp8, with and without autocast. Every case that the leaves do not cover takes the block path.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_pair_inputs, tiny_pair_model
from torch import nn

from hf_switchback import SwitchBackConfig, apply_switchback
from hf_switchback.blocks import layer_leaves
from hf_switchback.kernels import graph_leaf

TORCH = SwitchBackConfig(backend="torch", min_tokens=0)
BLOCK_MODES = [{}, {"fuse_qkv": True}, {"fuse_mlp": True}, {"fuse_qkv": True, "memory_efficient": True}]
LAYERS = 4  # tiny_pair_model: two encoder layers per tower


def run(model: nn.Module, device: str = "cpu", autocast: bool = False):
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        out = model(**tiny_pair_inputs(device=device), return_loss=True)
    out.loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.logits_per_image, grads


def count_plan_layers(monkeypatch) -> tuple[list, list]:
    """(a list that gets one entry per layer forward that took the 8-bit leaves, one for each that took the 16-bit
    path of blocks/layer_16bit.py)."""
    leaves, below = [], []
    forward = layer_leaves.forward

    def counted(layer, layer_plan, *args):
        (below if layer_plan[-1] else leaves).append(1)
        return forward(layer, layer_plan, *args)

    monkeypatch.setattr(layer_leaves, "forward", counted)
    return leaves, below


def count_leaf_layers(monkeypatch) -> list:
    """Appends one entry per layer forward that took the leaves."""
    return count_plan_layers(monkeypatch)[0]


def assert_equal(got, want):
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


def leaves_and_blocks(monkeypatch, base, config, device="cpu", autocast=False, compile_backend=None):
    """(the model's results with the leaves, without them, the number of layer forwards that took the leaves)."""
    results = []
    calls = count_leaf_layers(monkeypatch)
    for enabled in (True, False):
        monkeypatch.setattr(layer_leaves, "ENABLED", enabled)
        model = apply_switchback(copy.deepcopy(base), config)
        if compile_backend is not None:
            torch._dynamo.reset()
            model = torch.compile(model, backend=compile_backend, fullgraph=True)
        results.append(run(model, device, autocast))
    return results[0], results[1], len(calls)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("modes", BLOCK_MODES)
def test_leaves_compute_what_the_blocks_compute(kind, precision, modes, monkeypatch):
    got, want, calls = leaves_and_blocks(
        monkeypatch, tiny_pair_model(kind), TORCH.replace(precision=precision, **modes)
    )
    assert calls == LAYERS
    assert_equal(got, want)


@pytest.mark.parametrize("modes", [{}, {"fuse_qkv": True, "memory_efficient": True}])
def test_leaves_under_autocast(modes, monkeypatch):
    # float32 residual stream, bfloat16 linears: the residual add's dtype is float32 (plan's promotion)
    got, want, calls = leaves_and_blocks(
        monkeypatch, tiny_pair_model("clip"), TORCH.replace(**modes), autocast=True
    )
    assert calls == LAYERS
    assert_equal(got, want)


@pytest.mark.parametrize(
    ("modes", "autocast", "leaf_layers"),
    [
        # min_tokens between the tiny batch's 20 image tokens and 48 text tokens: the vision layers take the 16-bit
        # path (blocks/layer_16bit.py), the text layers the 8-bit leaves
        ({"min_tokens": 30}, True, 2),
        ({"fuse_qkv": True, "fuse_mlp": True}, False, LAYERS),
    ],
)
def test_compiled_leaves_compute_what_the_compiled_blocks_compute(modes, autocast, leaf_layers, monkeypatch):
    leaves, below = count_plan_layers(monkeypatch)
    got, want, _ = leaves_and_blocks(
        monkeypatch,
        tiny_pair_model("clip"),
        TORCH.replace(**modes),
        autocast=autocast,
        compile_backend="aot_eager",
    )
    # each layer traced once into the whole model's graph, with the layer's own paths on
    assert len(leaves) == leaf_layers and len(below) == LAYERS - leaf_layers
    assert_equal(got, want)


def test_dynamo_records_two_leaves_per_layer():
    """What Dynamo's graph of a layer holds: the two layer leaves around the stock attention, no block-level leaf."""
    model = apply_switchback(tiny_pair_model("clip"), TORCH)
    layer = model.vision_model.encoder.layers[0]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    h = torch.randn(3, 5, 64, requires_grad=True)
    want = layer(h, None)
    got = torch.compile(layer, backend=backend, fullgraph=True)(h, None)
    assert torch.equal(got, want)
    (gm,) = graphs
    leaves = [n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.target is graph_leaf._leaf]
    assert leaves == ["layer_attention_inputs", "layer_attention_output"]


def _hook_attention(model):
    model.vision_model.encoder.layers[0].self_attn.register_forward_hook(lambda m, args, out: None)


def _hook_mlp(model):
    model.text_model.encoder.layers[1].mlp.register_forward_pre_hook(lambda m, args: None)


def _backward_hook_on_attention(model):
    model.text_model.encoder.layers[0].self_attn.register_full_backward_hook(lambda m, gin, gout: None)


def _forward_set_on_mlp(model):
    mlp = model.vision_model.encoder.layers[1].mlp
    mlp.forward = mlp.forward  # an instance attribute, which the module's __call__ runs


def _fc2_config_equal_not_same(model):
    # an equal config object of its own (the block path then runs fc2 with it): not the layer's one config
    import dataclasses

    fc2 = model.vision_model.encoder.layers[0].mlp.fc2
    fc2.switchback_config = dataclasses.replace(fc2.switchback_config)


def _k_config_equal_not_same(model):
    # the attention block's own check accepts an equal config; the leaves take one config object only
    import dataclasses

    k = model.text_model.encoder.layers[0].self_attn.k_proj
    k.switchback_config = dataclasses.replace(k.switchback_config)


def _hook_q_proj(model):
    model.vision_model.encoder.layers[1].self_attn.q_proj.register_forward_pre_hook(lambda m, args: None)


def _hook_fc1(model):
    model.text_model.encoder.layers[1].mlp.fc1.register_forward_hook(lambda m, args, out: None)


def _hook_layer_norm2(model):
    model.vision_model.encoder.layers[0].layer_norm2.register_forward_hook(lambda m, args, out: None)


def _activation_replaced(model):
    # another activation than the one the MLP was fused with: the stock MLP forward runs it
    model.text_model.encoder.layers[0].mlp.activation_fn = nn.ReLU()


def _narrow_out_proj(model):
    # out_proj back to nn.Linear: its quantize kernel has no 8-bit op to feed
    attn = model.vision_model.encoder.layers[0].self_attn
    attn.out_proj = attn.out_proj.to_linear()


@pytest.mark.parametrize(
    ("change", "leaf_layers"),
    [
        (_hook_attention, LAYERS - 1),
        (_hook_mlp, LAYERS - 1),
        (_backward_hook_on_attention, LAYERS - 1),
        (_forward_set_on_mlp, LAYERS - 1),
        (_fc2_config_equal_not_same, LAYERS - 1),
        (_narrow_out_proj, LAYERS - 1),
        (_k_config_equal_not_same, LAYERS - 1),
        (_hook_q_proj, LAYERS - 1),
        (_hook_fc1, LAYERS - 1),
        (_hook_layer_norm2, LAYERS - 1),
        (_activation_replaced, LAYERS - 1),
    ],
)
def test_what_the_leaves_do_not_cover_takes_the_block_path(change, leaf_layers, monkeypatch):
    base = tiny_pair_model("clip")
    calls = count_leaf_layers(monkeypatch)
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(layer_leaves, "ENABLED", enabled)
        model = apply_switchback(copy.deepcopy(base), TORCH)
        change(model)
        results.append(run(model))
    assert len(calls) == leaf_layers
    assert_equal(*results)


def test_a_global_module_hook_takes_the_block_path(monkeypatch):
    calls, below = count_plan_layers(monkeypatch)
    model = apply_switchback(tiny_pair_model("clip"), TORCH)
    seen = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m).__name__)
    )
    try:
        run(model)
    finally:
        handle.remove()
    assert not calls and not below and "SwitchBackCLIPMLP" in seen and "SwitchBackCLIPAttention" in seen
    run(model)
    assert len(calls) == LAYERS


def test_without_the_activation_producer_the_blocks_run(monkeypatch):
    """fuse_activation off: fc2 quantizes its own input, a path the leaves do not cover."""
    got, want, calls = leaves_and_blocks(
        monkeypatch, tiny_pair_model("clip"), TORCH.replace(fuse_activation=False)
    )
    assert calls == 0
    assert_equal(got, want)


@pytest.mark.parametrize("modes", [{}, {"fuse_mlp": True, "memory_efficient": True}])
def test_leaves_take_the_cached_weight_operands(modes, monkeypatch):
    """KernelOptions.cache_weight_operands: each leaf gets the six layers' cached 8-bit weights, as the blocks do."""
    from hf_switchback import KernelOptions

    handed = []
    operands_for = layer_leaves.operands_for
    monkeypatch.setattr(
        layer_leaves, "operands_for", lambda layer: handed.append(operands_for(layer)) or handed[-1]
    )
    config = TORCH.replace(kernel_options=KernelOptions(cache_weight_operands=True), **modes)
    got, want, calls = leaves_and_blocks(monkeypatch, tiny_pair_model("clip"), config)
    assert calls == LAYERS and len(handed) == 6 * LAYERS
    assert all(operands is not None for operands in handed)
    assert_equal(got, want)


def test_output_attentions_runs_the_blocks(monkeypatch):
    """transformers hooks every attention block to record its weights; the layers then take the block path, with
    the same outputs, and keep it (the hook stays: the documented cost of asking for attentions once)."""
    calls = count_leaf_layers(monkeypatch)
    model = apply_switchback(tiny_pair_model("clip"), TORCH)
    inputs = tiny_pair_inputs()
    want = model(**inputs).logits_per_image
    assert len(calls) == LAYERS
    out = model(**inputs, output_attentions=True)
    assert len(calls) == LAYERS  # no layer took the leaves
    assert all(layer.self_attn._forward_hooks for layer in model.vision_model.encoder.layers)
    assert torch.equal(out.logits_per_image, want)
    model(**inputs)
    assert len(calls) == LAYERS  # the hook stays


BELOW = TORCH.replace(min_tokens=10**6)  # every linear of the tiny model below its token floor


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize("modes", BLOCK_MODES)
@pytest.mark.parametrize("autocast", [False, True])
def test_below_every_floor_the_layer_computes_what_the_blocks_compute(kind, modes, autocast, monkeypatch):
    """Every linear below its token floor: the stock layer's calls (blocks/layer_16bit.py), bitwise what the block
    path computes (each linear's exact 16-bit matmul), logits and gradients."""
    leaves, below = count_plan_layers(monkeypatch)
    got, want, _ = leaves_and_blocks(
        monkeypatch, tiny_pair_model(kind), BELOW.replace(**modes), autocast=autocast
    )
    assert not leaves and len(below) == LAYERS
    assert_equal(got, want)


def test_linears_on_both_sides_of_their_floors_take_the_block_path(monkeypatch):
    """Floors per shape (min_tokens=None reads the GPU's crossover table): with some of the six linears above
    theirs and some below, neither of the layer's own paths applies."""
    leaves, below = count_plan_layers(monkeypatch)
    monkeypatch.setattr(layer_leaves, "token_floor_range", lambda config, device, *shapes: (0, 10**6))
    got, want, _ = leaves_and_blocks(monkeypatch, tiny_pair_model("clip"), TORCH.replace(min_tokens=None))
    assert not leaves and not below
    assert_equal(got, want)
    monkeypatch.setattr(layer_leaves, "token_floor_range", lambda config, device, *shapes: (10**6, 10**6))
    monkeypatch.setattr(layer_leaves, "ENABLED", True)
    run(apply_switchback(tiny_pair_model("clip"), TORCH.replace(min_tokens=None)))
    assert not leaves and len(below) == LAYERS


@pytest.mark.parametrize("autocast", [False, True])
def test_dynamo_records_the_stock_layers_calls_below_the_floor(autocast):
    """Below every floor, the graph Dynamo records for a layer holds the stock layer's calls, one for one."""
    base = tiny_pair_model("clip")
    stock = copy.deepcopy(base).vision_model.encoder.layers[0]
    ours = apply_switchback(base, BELOW).vision_model.encoder.layers[0]
    h = torch.randn(3, 5, 64)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for layer in (stock, ours):
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            torch.compile(layer, backend=backend, fullgraph=True)(h, None)
    calls = [[n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")] for gm in graphs]
    assert len(calls) == 2 and calls[1] == calls[0] and len(calls[0]) > 10


def check_on_gpu(monkeypatch, config, leaf_layers: int) -> None:
    """The tiny CLIP on CUDA under bf16 autocast, the layers' own paths against the block path: eager bitwise
    (leaf_layers layers through the 8-bit leaves, the others through the 16-bit path); compiled with Inductor
    within float32 summation order of the block path compiled (the graphs hold the same operators; Inductor may
    fuse their pointwise neighbours otherwise)."""
    leaves, below = count_plan_layers(monkeypatch)
    base = tiny_pair_model("clip").cuda()
    got, want, _ = leaves_and_blocks(monkeypatch, base, config, "cuda", autocast=True)
    assert len(leaves) == leaf_layers and len(below) == LAYERS - leaf_layers
    assert_equal(got, want)
    got, want, _ = leaves_and_blocks(
        monkeypatch, base, config, "cuda", autocast=True, compile_backend="inductor"
    )
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=2e-2, atol=1e-3, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("modes", BLOCK_MODES)
def test_gpu_leaves_compute_what_the_blocks_compute(precision, modes, monkeypatch):
    """The Triton kernels: every layer through the 8-bit leaves."""
    check_on_gpu(monkeypatch, SwitchBackConfig(min_tokens=0, precision=precision, **modes), LAYERS)


@pytest.mark.gpu
@pytest.mark.parametrize("modes", [{}, {"fuse_mlp": True}])
def test_gpu_below_every_floor_computes_what_the_blocks_compute(modes, monkeypatch):
    """The 16-bit path (blocks/layer_16bit.py): the same cuBLAS matmuls as the block path's exact linears."""
    check_on_gpu(monkeypatch, SwitchBackConfig(min_tokens=10**6, **modes), 0)
