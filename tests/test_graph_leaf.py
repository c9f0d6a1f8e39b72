"""kernels/graph_leaf.py: under torch.compile each SwitchBack op is one node of Dynamo's graph, traced by AOT
autograd into the same computation as eager mode.

The reference is the eager layer (the same ops run by plain Python); CPU, torch backend, so the compiled graph
(aot_eager: AOT autograd's traced forward and backward, run without Inductor) computes exactly what eager does.
"""

import collections

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from transformers import CLIPVisionConfig
from transformers.models.clip.modeling_clip import CLIPEncoderLayer

from hf_switchback import SwitchBackConfig, apply_switchback
from hf_switchback.kernels import graph_leaf


def _layer(**config) -> CLIPEncoderLayer:
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4)
    vision._attn_implementation = "sdpa"
    layer = CLIPEncoderLayer(vision)
    apply_switchback(torch.nn.Sequential(layer), SwitchBackConfig(backend="torch", min_tokens=0, **config))
    return layer


def _dynamo_graph_calls(layer, x) -> collections.Counter:
    """What Dynamo's graph of layer(x) calls: leaf op names, and the names of other call_function targets."""
    calls = collections.Counter()

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                leaf = node.target is graph_leaf._leaf
                calls[
                    f"leaf:{node.args[0]}" if leaf else getattr(node.target, "__name__", str(node.target))
                ] += 1
        return gm.forward

    torch._dynamo.reset()
    torch.compile(layer, backend=backend, fullgraph=True)(x, None)
    torch._dynamo.reset()
    return calls


@pytest.mark.parametrize(
    ("config", "ops"),
    [
        (dict(fuse_norm=False, fuse_activation=False), {"switchback_linear_call": 6}),
        (
            dict(),  # library defaults: the LayerNorm producers, fc1 + activation as one op
            {
                "layernorm_quantize": 1,
                "add_layernorm_quantize": 1,
                "switchback_linear_call": 5,  # q, k, v, out_proj, fc2
                "quantize_rows": 1,
                "switchback_linear_activation_call": 1,
            },
        ),
        (
            dict(fuse_qkv=True, fuse_mlp=True),
            {
                "layernorm_quantize": 1,
                "add_layernorm_quantize": 1,
                "switchback_qkv_call": 1,
                "quantize_rows": 1,
                "switchback_linear_call": 1,  # out_proj
                "switchback_mlp_call": 1,
            },
        ),
    ],
)
def test_each_switchback_op_is_one_node_of_dynamos_graph(config, ops, monkeypatch):
    """With the blocks' forwards (the layer's two leaves off: blocks/layer_leaves.py)."""
    from hf_switchback.blocks import layer_leaves

    monkeypatch.setattr(layer_leaves, "ENABLED", False)
    calls = _dynamo_graph_calls(_layer(**config), torch.randn(2, 16, 64))
    leaves = {name.removeprefix("leaf:"): n for name, n in calls.items() if name.startswith("leaf:")}
    assert (
        leaves == ops
    )  # one node per public call: the op inside it (e.g. "switchback_linear") is not traced
    # nothing of an op's autograd Function was traced by Dynamo
    assert "autograd_function_apply" not in calls, calls


@pytest.mark.parametrize("config", [dict(), dict(fuse_qkv=True, fuse_mlp=True)])
def test_a_layer_with_every_part_8bit_is_two_nodes_of_dynamos_graph(config):
    calls = _dynamo_graph_calls(_layer(**config), torch.randn(2, 16, 64))
    leaves = {name.removeprefix("leaf:"): n for name, n in calls.items() if name.startswith("leaf:")}
    assert leaves == {"layer_attention_inputs": 1, "layer_attention_output": 1}
    assert "autograd_function_apply" not in calls, calls


@pytest.mark.parametrize(
    "config", [dict(), dict(fuse_norm=False, fuse_activation=False), dict(fuse_qkv=True, fuse_mlp=True)]
)
def test_compiled_layer_computes_what_eager_does(config):
    layer = _layer(**config, memory_efficient=config.get("fuse_mlp", False))
    x = torch.randn(2, 16, 64)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        run = (
            torch.compile(layer, backend=aot_autograd(fw_compiler=_run, bw_compiler=_run))
            if compiled
            else layer
        )
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(xi, None)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().sum().backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        results.append((out.detach(), xi.grad, *grads))
    torch._dynamo.reset()
    for compiled, eager in zip(results[1], results[0], strict=True):
        # the same ops in the same order; float32 reductions may be reassociated by AOT's decompositions
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def _run(gm, example_inputs):
    return make_boxed_func(gm.forward)


_PROBE_SEEN: list[bool] = []


@graph_leaf.op("test_graph_leaf_probe")
def _probe(x):
    _PROBE_SEEN.append(graph_leaf.compiling())
    return x * 2


def test_compiling_is_true_inside_a_leaf_and_outside_only_while_dynamo_traces():
    _PROBE_SEEN.clear()
    assert graph_leaf.call("test_graph_leaf_probe", torch.ones(2)).tolist() == [
        2.0,
        2.0,
    ]  # eager: a plain call
    assert graph_leaf.compiling() is False

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: graph_leaf.call("test_graph_leaf_probe", x) + 1, backend="eager")
    out = compiled(torch.ones(2))
    torch._dynamo.reset()
    assert out.tolist() == [3.0, 3.0]
    # eager first, then Dynamo's run on fake tensors and the graph's run, both inside the leaf
    assert _PROBE_SEEN[0] is False and len(_PROBE_SEEN) >= 2 and all(_PROBE_SEEN[1:]), _PROBE_SEEN


@pytest.mark.parametrize("config", [dict(), dict(fuse_qkv=True, fuse_mlp=True)])
def test_backward_runs_the_kernel_set_its_forward_chose(monkeypatch, config):
    # AOT autograd traces an op's backward after the leaf returned, where graph_leaf.compiling() may no longer
    # hold: a backward that asked for a kernel set again could get another one than its forward ran
    import inspect

    from hf_switchback import functional
    from hf_switchback.blocks import linear_activation, producers, qkv

    asked_in_backward = []
    for module in (functional, linear_activation, producers, qkv):
        original = module.get_kernels

        def spy(*args, _original=original, **kwargs):
            frames = [f.function for f in inspect.stack(context=0)[1:]]
            asked_in_backward.append("backward" in frames)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "get_kernels", spy)
    layer = _layer(**config)
    x = torch.randn(2, 16, 64, requires_grad=True)
    out = layer(x, None)
    (out[0] if isinstance(out, tuple) else out).square().sum().backward()
    assert asked_in_backward and not any(asked_in_backward)


def test_an_op_name_is_registered_once():
    with pytest.raises(ValueError, match="registered twice"):
        graph_leaf.op("switchback_linear")(lambda *args: None)
