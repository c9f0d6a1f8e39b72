"""SimSwitchBackLinear: all-int8 SwitchBack simulated in torch, with a chosen output-gradient quantizer.

The tensor-wise-weight SwitchBack linear (int8 row-wise input x int8 tensor-wise weight in forward, 16-bit
grad-weight) with the grad-input GEMM's output gradient quantized by one of
`grad_quant_sim`'s quantizers. Everything is fake-quantized (quantize, dequantize,
float32 matmul): it measures accuracy on any device, not speed.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_switchback import SwitchBackConfig
from hf_switchback.convert import find_targets

from .grad_quant_sim import (
    fake_quant_grad,
    fake_quant_rows,
    fake_quant_tensor,
    gradient_stats,
    parse_grad_quantizer,
)


class _SimSwitchBackFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module):
        ctx.module = module
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        # float32 GEMM of the dequantized operands (exact for int8 x int8 up to float32 summation), not autocast's
        # bf16, which would round the operands a second time
        with torch.autocast(x.device.type, enabled=False):
            out = fake_quant_rows(x2) @ fake_quant_tensor(weight).t()
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        module = ctx.module
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        if module.record is not None:
            module.record.append(gradient_stats(g2, weight, module.stat_quantizers))
        gq = fake_quant_grad(g2, module.grad_quantizer, module.generator)
        grad_x = (gq @ fake_quant_tensor(weight)).to(x.dtype).view_as(x)
        # grad-weight stays 16-bit, as in SwitchBack
        grad_w = (g2.t().to(x2.dtype) @ x2).to(weight.dtype)
        grad_b = g2.sum(dim=0).to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class SimSwitchBackLinear(nn.Linear):
    """nn.Linear with simulated all-int8 SwitchBack arithmetic and a chosen output-gradient quantizer.

    `record`: a list to append gradient_stats of every backward to (None: off), over `stat_quantizers`.
    """

    def __init__(self, in_features, out_features, bias=True, grad_quantizer="row", device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        parse_grad_quantizer(grad_quantizer)
        self.grad_quantizer = grad_quantizer
        self.generator: torch.Generator | None = None
        self.record: list | None = None
        self.stat_quantizers: tuple[str, ...] = ("row",)

    @classmethod
    def from_linear(cls, linear: nn.Linear, grad_quantizer: str) -> SimSwitchBackLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameters
        parse_grad_quantizer(grad_quantizer)
        new.grad_quantizer, new.generator, new.record, new.stat_quantizers = (
            grad_quantizer,
            None,
            None,
            ("row",),
        )
        if parse_grad_quantizer(grad_quantizer)[0] == "row-sr":
            new.generator = torch.Generator(device=linear.weight.device)
            new.generator.manual_seed(0)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SimSwitchBackFunction.apply(x, self.weight, self.bias, self)


def apply_sim_switchback(model: nn.Module, grad_quantizer: str, config=None) -> list[SimSwitchBackLinear]:
    """Swap the linears SwitchBack would swap (same target selection) for SimSwitchBackLinear; returns them."""
    targets = find_targets(model, config or SwitchBackConfig())
    replacements = {
        name: SimSwitchBackLinear.from_linear(model.get_submodule(name), grad_quantizer) for name in targets
    }
    for name, module in replacements.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module)  # single-process runs: no sharding to keep
        module.name = name  # gradient statistics are reported by layer kind
    return list(replacements.values())
