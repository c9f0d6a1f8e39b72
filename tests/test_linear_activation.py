"""fc1 + activation as one backward node (blocks/linear_activation.py, config.fuse_activation): against the
separate ops it replaces (switchback_linear, then the activation writing fc2's 8-bit input) and against float64.

On the reference path both sides compute the same formulas (quick_gelu's derivative in float32, the same
row-wise quantize of the same rounded gradient), so they must agree bitwise; the GELU kinds' separate path
takes aten.gelu_backward, whose float32 arithmetic may differ in the last bit, so they agree to the gradient
dtype's rounding. Both lie within SwitchBack's error of the exact float64 result.
"""

from __future__ import annotations

import pytest
import torch

from hf_switchback import SwitchBackConfig
from hf_switchback.blocks.linear_activation import switchback_linear_activation
from hf_switchback.blocks.producers import activation_quantize
from hf_switchback.functional import switchback_linear
from hf_switchback.kernels import reference

TORCH = SwitchBackConfig(backend="torch", min_tokens=0)


def inputs(seed: int = 0, tokens: int = 24, d: int = 16, hidden: int = 64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens // 2, d, generator=gen)
    w = torch.randn(hidden, d, generator=gen) / d**0.5
    b = torch.randn(hidden, generator=gen) * 0.1
    g = torch.randn(2, tokens // 2, hidden, generator=gen)  # the gradient arriving at act(h)
    return x, w, b, g


def run(fn, x, w, b, g):
    x, w, b = (t.clone().requires_grad_(True) for t in (x, w, b))
    a, (q, scale) = fn(x, w, b)
    (a * g.to(a.dtype)).sum().backward()
    return a.detach(), q, scale, x.grad, w.grad, b.grad


def fused(activation, cfg):
    return lambda x, w, b: switchback_linear_activation(x, w, b, activation, cfg)


def separate(activation, cfg):
    return lambda x, w, b: activation_quantize(switchback_linear(x, w, b, cfg), activation, cfg)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_matches_the_separate_ops_bitwise_on_the_reference_path(precision, memory_efficient):
    cfg = TORCH.replace(precision=precision, memory_efficient=memory_efficient)
    args = inputs()
    got, want = run(fused("quick_gelu", cfg), *args), run(separate("quick_gelu", cfg), *args)
    for name, g, w in zip(("a", "q", "scale", "grad x", "grad w", "grad b"), got, want, strict=True):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_gelu_kinds_match_the_stock_gelu_backward(activation):
    """The separate path's aten.gelu_backward against the kernels' derivative: same values to float32 rounding."""
    args = inputs(1)
    got, want = run(fused(activation, TORCH), *args), run(separate(activation, TORCH), *args)
    for name, g, w in zip(("a", "q", "scale", "grad x", "grad w", "grad b"), got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-5, atol=1e-5, msg=name)


def test_within_switchback_error_of_float64():
    """Against act(x W^T + b) in float64: the forward within the int8 input and weight rounding, the gradients
    within it (act'(h) is taken at the 8-bit forward's h) plus the gradient's own row-wise rounding (relative
    norms; measured 0.8-1.4e-2 at these sizes)."""
    x, w, b, g = inputs(2, tokens=64, d=32, hidden=128)
    a, _, _, gx, gw, gb = run(fused("gelu", TORCH), x, w, b, g)
    xd, wd, bd = (t.double().requires_grad_(True) for t in (x, w, b))
    ad = reference.apply_activation(xd @ wd.T + bd, "gelu")
    (ad * g.double()).sum().backward()

    def rel(got, exact):
        return ((got.double() - exact).norm() / exact.norm()).item()

    assert rel(a, ad.detach()) < 0.02
    assert rel(gx, xd.grad) < 0.03 and rel(gw, wd.grad) < 0.02 and rel(gb, bd.grad) < 0.02


def test_refuses_the_16bit_path_and_checks_quantized_input():
    x, w, b, _ = inputs()
    with pytest.raises(ValueError, match="8-bit path only"):
        switchback_linear_activation(x, w, b, "gelu", TORCH.replace(min_tokens=10_000))
    with pytest.raises(ValueError, match="quantized_input"):
        bad = (torch.zeros(3, 16, dtype=torch.int8), torch.ones(3))
        switchback_linear_activation(x, w, b, "gelu", TORCH, quantized_input=bad)
