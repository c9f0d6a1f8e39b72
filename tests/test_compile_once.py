"""A whole-model torch.compile of a SwitchBack model traces each tower's fused encoder layer as one nested compile
region that every layer of the tower calls (blocks/compile_once.py), trains as the eager model does, and leaves
the layers inlined with HF_SWITCHBACK_NESTED_COMPILE_REGION=0 or on a torch without nested compile regions."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_clip_config, tiny_pair_inputs, tiny_pair_model
from transformers import CLIPModel

from hf_switchback import SwitchBackConfig, apply_switchback, remove_switchback
from hf_switchback.blocks import compile_once
from hf_switchback.blocks.encoder_layer import is_fused_layer

TORCH = SwitchBackConfig(backend="torch", min_tokens=0)


def three_layer_clip() -> CLIPModel:
    torch.manual_seed(0)
    config = tiny_clip_config(layers=3, hidden=64)
    config._attn_implementation = "sdpa"  # the eager attention's logging is a graph break under fullgraph
    return CLIPModel(config).train()


def model_of(kind: str):
    if kind == "clip":
        return three_layer_clip()
    model = tiny_pair_model("siglip").train()
    model.config._attn_implementation = "sdpa"
    for tower in (model.config.text_config, model.config.vision_config):
        tower._attn_implementation = "sdpa"
    return model


def subgraph_calls(model) -> list[str]:
    """The subgraph each invoke_subgraph call of the whole model's Dynamo graph runs, in call order."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=recording_backend, fullgraph=True)(**tiny_pair_inputs(), return_loss=True)
    assert len(graphs) == 1
    return [
        node.args[0].target
        for node in graphs[0].graph.nodes
        if node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph
    ]


def fused_layer_count(model) -> int:
    return sum(is_fused_layer(module) for module in model.modules())


@pytest.mark.skipif(not compile_once.available(), reason="this torch has no torch.compiler.nested_compile_region")
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_each_towers_layer_is_traced_once_and_called_by_every_layer(kind):
    model = apply_switchback(model_of(kind), TORCH)
    layers = fused_layer_count(model)
    assert layers == (6 if kind == "clip" else 4)
    calls = subgraph_calls(model)
    assert len(calls) == layers
    assert len(set(calls)) == 2  # one per tower (their widths and sequence lengths differ)
    per_tower = layers // 2
    assert len(set(calls[:per_tower])) == 1 and len(set(calls[per_tower:])) == 1


def test_the_environment_variable_or_an_older_torch_inline_the_layers(monkeypatch):
    base = three_layer_clip()
    monkeypatch.setenv(compile_once.ENV_VAR, "0")
    model = apply_switchback(copy.deepcopy(base), TORCH)
    assert fused_layer_count(model) == 6
    assert subgraph_calls(model) == []
    monkeypatch.delenv(compile_once.ENV_VAR)
    if compile_once.available():
        apply_switchback(model, TORCH)  # applied again: the setting now in force
        assert len(subgraph_calls(model)) == 6
        monkeypatch.delattr(torch.compiler, "nested_compile_region")
    model = apply_switchback(copy.deepcopy(base), TORCH)
    assert fused_layer_count(model) == 6
    assert subgraph_calls(model) == []


@pytest.mark.skipif(not compile_once.available(), reason="this torch has no torch.compiler.nested_compile_region")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_whole_model_compile_trains_as_eager(checkpointing):
    """AOT autograd over the nested regions (forward, backward, recomputation under gradient checkpointing):
    loss and every gradient as the eager model's (the same float32 ops, reordered: tolerances of rounding)."""
    base = three_layer_clip()
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    eager = apply_switchback(copy.deepcopy(base), TORCH)
    model = apply_switchback(copy.deepcopy(base), TORCH)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for module, run in ((eager, eager), (model, compiled)):
        loss = run(**tiny_pair_inputs(), return_loss=True).loss
        loss.backward()
        module.loss = loss.detach()
    torch.testing.assert_close(model.loss, eager.loss, rtol=1e-6, atol=1e-6)
    for (name, got), want in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_remove_switchback_gives_the_marked_layers_their_class_back():
    base = three_layer_clip()
    model = apply_switchback(copy.deepcopy(base), TORCH)
    remove_switchback(model)
    assert {type(m) for m in model.modules()} == {type(m) for m in base.modules()}
    assert subgraph_calls(model) == []
