"""SwitchBackLinear: a drop-in nn.Linear whose matmuls run in 8-bit."""

from __future__ import annotations

import torch
from torch import nn

from .accelerate_fp8 import check_accelerate_fp8
from .config import SwitchBackConfig
from .functional import switchback_linear, token_floor
from .kernels import crossover
from .weight_cache import cached_linear, drop_weight_cache, has_weight_cache
from .weight_operands import operands_for


class SwitchBackLinear(nn.Linear):
    """nn.Linear with SwitchBack numerics. Same Parameters, same state_dict keys, same init.

    Being an nn.Linear subclass keeps isinstance checks in transformers/accelerate/PEFT working; the
    variant lives in `self.switchback_config`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        config: SwitchBackConfig | None = None,
    ) -> None:
        if config is not None and not isinstance(config, SwitchBackConfig):
            raise TypeError(
                f"SwitchBackLinear: config must be a SwitchBackConfig, got {type(config).__name__}"
            )
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.switchback_config = config or SwitchBackConfig()

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: SwitchBackConfig | None = None) -> SwitchBackLinear:
        """Wrap `linear`, reusing its weight/bias Parameter objects.

        The new layer is built on the meta device (no allocation, no re-init), then takes over the original
        Parameters: their device, dtype, sharding (FSDP2 DTensors) and the references an already-built
        optimizer holds all survive the swap.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        # accelerate fp8 would later replace this layer and silently drop SwitchBack (see accelerate_fp8.py).
        check_accelerate_fp8()
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear holding this layer's Parameters (the inverse of from_linear)."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = self.weight
        linear.bias = self.bias
        linear.train(self.training)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # After prepare_for_inference(): no-grad forwards reuse the once-quantized weight.
        if has_weight_cache(self):
            if not torch.is_grad_enabled():
                return cached_linear(self, x)
            # A grad-enabled forward means training resumed: the optimizer step that follows may change the
            # weight without bumping its version (bitsandbytes' 8-bit optimizers write in place through
            # kernels), so the cache could go stale undetected. Drop it; prepare_for_inference() re-builds it.
            drop_weight_cache(self)
        operands = operands_for(self, x)
        return switchback_linear(x, self.weight, self.bias, self.switchback_config, weight_operands=operands)

    def extra_repr(self) -> str:
        # What this layer runs where its weight is (one linear's floor; a fused MLP block runs from the larger
        # of fc1's and fc2's, see precision_summary), so the repr never claims a path that is not taken.
        cfg = self.switchback_config
        shape = (self.in_features, self.out_features)
        floor = token_floor(cfg, self.weight.device, shape, compiled=False)
        runs = runs_text(floor, cfg.precision)
        compiled = token_floor(cfg, self.weight.device, shape, compiled=True)
        if compiled != floor:  # a table measured under torch.compile says otherwise there
            runs += f" (under torch.compile: {runs_text(compiled, cfg.precision)})"
        return f"{super().extra_repr()}, switchback={cfg.variant}, backend={cfg.backend}, runs={runs}"


def runs_text(floor: int, precision: str) -> str:
    """A layer's path for a token floor: "int8", "16-bit below 16384 tokens", "16-bit (int8 never pays here)"."""
    if floor == 0:
        return precision
    if floor >= crossover.NEVER:
        return f"16-bit ({precision} never pays here)"
    return f"16-bit below {floor} tokens"


def is_plain_layer(layer: nn.Module) -> bool:
    """A SwitchBackLinear whose forward is exactly its op (no subclass, no hooks, no inference cache): a block of
    ours may call the op in its place (with the 8-bit input a producer wrote)."""
    return (
        type(layer) is SwitchBackLinear
        and not (layer._forward_hooks or layer._forward_pre_hooks)
        and not has_weight_cache(layer)
    )


__all__ = ["SwitchBackLinear", "is_plain_layer"]
