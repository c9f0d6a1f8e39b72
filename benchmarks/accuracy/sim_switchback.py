"""All-int8 SwitchBack simulated in torch, with a chosen output-gradient quantizer: accuracy on any device, no speed.

Forward: row-wise int8 input x tensor-wise int8 weight; grad-input: the output gradient quantized by `row` (the
paper's one scale per token: entries below absmax / 254 of their row flush to zero) or `block<N>` (one scale per
1 x N run of each row); grad-weight stays 16-bit. Operands are quantized, dequantized and multiplied in float32.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from hf_switchback import SwitchBackConfig
from hf_switchback.convert import find_targets

QMAX = 127.0
QUANTIZER = re.compile(r"row|block([1-9]\d*)")  # the output-gradient quantizer names


def block_size(quantizer: str) -> int | None:
    """The block length of a gradient quantizer name: None for "row", N for "block<N>"."""
    match = QUANTIZER.fullmatch(quantizer)
    if match is None:
        raise ValueError(f"unknown gradient quantizer {quantizer!r}: use row or block<N>, e.g. sim-block64")
    return int(match.group(1)) if match.group(1) else None


def fake_quant(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Absmax int8 of x (M, K), dequantized to float32: one scale per row, or per 1 x `block` run of each row
    (the last run may be shorter). Rounds half to even; an all-zero row or run stays zero."""
    xf = x.float()
    m, k = xf.shape
    block = block or k
    pad = (-k) % block
    runs = nn.functional.pad(xf, (0, pad)).view(m, (k + pad) // block, block)
    scale = runs.abs().amax(dim=2, keepdim=True) / QMAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.round(runs / scale).clamp(-QMAX, QMAX) * scale).view(m, k + pad)[:, :k]


def fake_quant_tensor(w: torch.Tensor) -> torch.Tensor:
    """Tensor-wise absmax int8 (one scale for the whole weight), dequantized."""
    return fake_quant(w.reshape(1, -1)).view(w.shape)


class _SimSwitchBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, block):
        ctx.save_for_backward(x, weight)
        ctx.block = block
        # float32 GEMM of the dequantized operands: autocast's bf16 would round them a second time
        with torch.autocast(x.device.type, enabled=False):
            out = fake_quant(x.reshape(-1, x.shape[-1])) @ fake_quant_tensor(weight).t()
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = (fake_quant(g, ctx.block) @ fake_quant_tensor(weight)).to(x.dtype).view_as(x)
        grad_w = (g.t().to(x.dtype) @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
        grad_b = g.sum(dim=0).to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class SimSwitchBackLinear(nn.Module):
    """Takes over an nn.Linear's Parameters (the optimizer's references stay valid)."""

    def __init__(self, linear: nn.Linear, quantizer: str):
        super().__init__()
        self.weight, self.bias, self.block = linear.weight, linear.bias, block_size(quantizer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SimSwitchBack.apply(x, self.weight, self.bias, self.block)


def apply_sim_switchback(model: nn.Module, quantizer: str) -> int:
    """Swap the linears that apply_switchback would swap; returns how many."""
    targets = find_targets(model, SwitchBackConfig())
    for name in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, SimSwitchBackLinear(model.get_submodule(name), quantizer))
    return len(targets)
