"""Is accelerate about to train in fp8? Then SwitchBack layers must not be created (never quantize twice).

accelerate's `mixed_precision="fp8"` swaps every `nn.Linear` (subclasses included, so SwitchBackLinear too)
for Transformer Engine's `te.Linear` or torchao's `Float8Linear` inside `Accelerator.prepare`, silently
dropping SwitchBack. SwitchBackLinear.from_linear and the transformers quantizer call check_accelerate_fp8;
interop.py holds the model-wide checks. A leaf module: it imports only adapters/.
"""

from __future__ import annotations

import os

from .adapters.accelerate import accelerator_mixed_precision

FP8_CONFLICT = (
    "SwitchBack layers cannot run under accelerate's mixed_precision='fp8': Accelerator.prepare would replace "
    "every nn.Linear, SwitchBackLinear included, by Transformer Engine / torchao fp8 linears and drop SwitchBack. "
    "Pick one: SwitchBack fp8 training with mixed_precision='bf16' and SwitchBackConfig(precision='fp8'), or "
    "accelerate fp8 without hf_switchback."
)


def accelerate_fp8_enabled() -> bool:
    """True when accelerate will train in fp8: `accelerate launch --mixed_precision fp8` (env var) or an
    already created Accelerator(mixed_precision="fp8") in this process (its shared state)."""
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() == "fp8":
        return True
    return accelerator_mixed_precision() == "fp8"


def check_accelerate_fp8() -> None:
    """Raise RuntimeError (FP8_CONFLICT) when accelerate's fp8 mixed precision is active."""
    if accelerate_fp8_enabled():
        raise RuntimeError(FP8_CONFLICT)


__all__ = ["FP8_CONFLICT", "accelerate_fp8_enabled", "check_accelerate_fp8"]
