"""Guards against running SwitchBack under another 8-bit scheme (never quantize twice).

accelerate's `mixed_precision="fp8"` swaps every `nn.Linear` (subclasses included, so SwitchBackLinear too)
for Transformer Engine's `te.Linear` (accelerate.utils.transformer_engine.convert_model) or torchao's
`Float8Linear` (accelerate.utils.ao.convert_model_to_fp8_ao) inside `Accelerator.prepare`. Either way the
SwitchBack layers are silently replaced and their config is lost. The conversion happens inside accelerate,
so we check at the points where SwitchBack layers are created, which a user always passes through:
`SwitchBackLinear.from_linear` (apply_switchback, from_pretrained) and the transformers quantizer.
"""

from __future__ import annotations

from torch import nn

from .accelerate_fp8 import FP8_CONFLICT, accelerate_fp8_enabled, check_accelerate_fp8
from .modules import SwitchBackLinear


def foreign_linears(model: nn.Module) -> dict[str, str]:
    """Linear layers already converted by some other quantization library: name -> class name.

    Any nn.Linear subclass that is not SwitchBackLinear (torchao Float8Linear, bitsandbytes Linear8bitLt,
    ...), plus Transformer Engine's Linear, which is not an nn.Linear subclass at all.
    """
    found = {}
    for name, module in model.named_modules():
        cls = type(module)
        if isinstance(module, nn.Linear) and cls not in (nn.Linear, SwitchBackLinear):
            found[name] = cls.__name__
        elif cls.__name__ == "Linear" and cls.__module__.startswith("transformer_engine"):
            found[name] = f"{cls.__module__}.{cls.__name__}"
    return found


def check_fp8_interop(model: nn.Module | None = None) -> None:
    """Fail with a clear message when SwitchBack would be combined with another 8-bit linear scheme.

    Call it after creating the Accelerator and before `accelerator.prepare(model)` when the model was
    converted before the Accelerator existed (the from_linear guard cannot see a later Accelerator).
    """
    if model is not None:
        has_switchback = any(isinstance(m, SwitchBackLinear) for m in model.modules())
        foreign = foreign_linears(model)
        if has_switchback and foreign:
            shown = ", ".join(f"{n} ({c})" for n, c in list(foreign.items())[:4])
            raise RuntimeError(
                f"model mixes SwitchBack layers with linears quantized by another library: {shown}. "
                "SwitchBack must start from plain nn.Linear layers."
            )
        if not has_switchback:
            return
    check_accelerate_fp8()


__all__ = [
    "FP8_CONFLICT",
    "accelerate_fp8_enabled",
    "check_accelerate_fp8",
    "check_fp8_interop",
    "foreign_linears",
]
