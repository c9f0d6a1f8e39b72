"""Fused SwitchBack MLP: a CLIP block fc1 -> activation -> fc2 run as one op (functional.switchback_mlp).

When apply_switchback converts both linears of a transformers `CLIPMLP` (or SigLIP's `SiglipMLP` /
`Siglip2MLP`, the same block) with one config (and
`config.fuses_mlp`: fuse_mlp, or by default memory_efficient), the block's class is swapped for a generated subclass whose forward calls
`switchback_mlp` — the same technique `fully_shard` uses. Nothing else changes: the module is still an
instance of CLIPMLP, fc1 / fc2 are the same SwitchBackLinear modules holding the same Parameters, so
state_dict keys, FSDP2's parameter records and PEFT-style target names are untouched, and
remove_switchback restores the original class. The forward re-checks at every call that the block still
qualifies (both layers SwitchBackLinear with one config, the activation it was fused with, no inference
cache) and otherwise runs the stock CLIPMLP forward, so a later change never silently computes something else.

With `config.fuse_norm` (and fuse_mlp off) the block's class is swapped too, and its forward runs fc1's
SwitchBack op, the activation and fc2 as the stock forward does: so that it can take its input's 8-bit form as
`quantized_input` when the LayerNorm before it wrote that form (blocks/encoder_layer.py).
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import nn

from .functional import switchback_linear, switchback_mlp
from .modules import SwitchBackLinear
from .weight_cache import has_weight_cache

# Instance attribute set on fused blocks: (activation name for the kernels, type of activation_fn at fuse time).
_ACTIVATION_ATTR = "_switchback_activation"


def activation_kind(act: nn.Module) -> str | None:
    """The fused kernels' name for an activation module ("gelu", "gelu_tanh", "quick_gelu"), else None.

    Exact types only: a subclass may compute something else in its forward.
    """
    if type(act) is nn.GELU:
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    try:
        from transformers import activations as hf
    except ImportError:
        return None
    kinds = {
        "QuickGELUActivation": "quick_gelu",  # hidden_act="quick_gelu" (OpenAI CLIP)
        "GELUActivation": "gelu",  # hidden_act="gelu" (erf; OpenCLIP-converted configs)
        "GELUTanh": "gelu_tanh",  # "gelu_pytorch_tanh"
        "PytorchGELUTanh": "gelu_tanh",
        "NewGELUActivation": "gelu_tanh",  # "gelu_new": the same tanh formula
        "FastGELUActivation": "gelu_tanh",  # "gelu_fast": the same formula, constants written out
    }
    for class_name, kind in kinds.items():
        cls = getattr(hf, class_name, None)
        if cls is not None and type(act) is cls:
            return kind
    return None


@functools.cache
def _mlp_base_classes() -> tuple[type, ...]:
    """The transformers MLP blocks whose forward is exactly fc2(activation_fn(fc1(x)))."""
    classes = []
    for module, name in (("clip", "CLIPMLP"), ("siglip", "SiglipMLP"), ("siglip2", "Siglip2MLP")):
        try:
            classes.append(
                getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
            )
        except (ImportError, AttributeError):
            continue
    return tuple(classes)


def _unfused_class(module: nn.Module) -> type:
    return getattr(type(module), "_switchback_unfused_class", type(module))


def _qualifies(module: nn.Module) -> str | None:
    """Activation kind if `module` is a stock CLIPMLP whose fc1 and fc2 are SwitchBack with one fusing config."""
    base = _unfused_class(module)
    if not any(issubclass(base, c) and base.forward is c.forward for c in _mlp_base_classes()):
        return None
    fc1, fc2 = getattr(module, "fc1", None), getattr(module, "fc2", None)
    if not (isinstance(fc1, SwitchBackLinear) and isinstance(fc2, SwitchBackLinear)):
        return None
    cfg = fc1.switchback_config
    if cfg.fuse_norm and not cfg.fuses_mlp:
        return "any"  # fc1's op, then the stock activation_fn and fc2: any activation
    # Config equality leaves kernel_options out (same numerics): a fused block runs with fc1's.
    if not cfg.fuses_mlp or fc2.switchback_config != cfg:
        return None
    return activation_kind(module.activation_fn)


def _fused_config(module: nn.Module):
    """The SwitchBackConfig with which `module` (a block of our class) runs its own forward right now, else None
    (then the stock forward runs)."""
    fc1, fc2 = module.fc1, module.fc2
    kind, act_type = getattr(module, _ACTIVATION_ATTR)
    cfg = fc1.switchback_config if isinstance(fc1, SwitchBackLinear) else None
    # Inference mode (prepare_for_inference) serves no-grad forwards from the layers' weight caches.
    if cfg is None or has_weight_cache(fc1):
        return None
    if kind == "any":
        # fc1's op replaces fc1's forward: only where that forward is exactly it, with no hooks to skip
        plain = type(fc1) is SwitchBackLinear and not (fc1._forward_hooks or fc1._forward_pre_hooks)
        return cfg if cfg.fuse_norm and not cfg.fuses_mlp and plain else None
    if (
        not isinstance(fc2, SwitchBackLinear)
        or not cfg.fuses_mlp
        or not (fc2.switchback_config is cfg or fc2.switchback_config == cfg)
        or type(module.activation_fn) is not act_type
        or has_weight_cache(fc2)
    ):
        return None
    return cfg


def quantized_input_config(module: nn.Module):
    """The SwitchBackConfig with which `module`'s forward takes its input's 8-bit form (`quantized_input`) right
    now, else None."""
    if type(module) is not _FUSED_CLASSES.get(_unfused_class(module)):
        return None
    cfg = _fused_config(module)
    return cfg if cfg is not None and cfg.fuse_norm else None


def _fused_forward(
    self, hidden_states: torch.Tensor, *, quantized_input: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    cfg = _fused_config(self)
    if cfg is None:
        # (a quantized_input is only ever the LayerNorm output's 8-bit form: dropping it changes nothing)
        return self._switchback_unfused_class.forward(self, hidden_states)
    if not cfg.fuse_norm:
        quantized_input = None
    fc1, fc2 = self.fc1, self.fc2
    kind = getattr(self, _ACTIVATION_ATTR)[0]
    if kind == "any":
        h = switchback_linear(hidden_states, fc1.weight, fc1.bias, cfg, quantized_input=quantized_input)
        return fc2(self.activation_fn(h))
    return switchback_mlp(
        hidden_states, fc1.weight, fc1.bias, fc2.weight, fc2.bias, kind, cfg, quantized_input=quantized_input
    )


# unfused class -> its generated subclass, as _fused_class made them (read per call: see blocks/attention.py)
_FUSED_CLASSES: dict[type, type] = {}


@functools.cache
def _fused_class(base: type) -> type:
    fused = type(
        f"SwitchBack{base.__name__}",
        (base,),
        {"forward": _fused_forward, "_switchback_unfused_class": base, "__module__": __name__},
    )
    _FUSED_CLASSES[base] = fused
    return fused


def is_fused_mlp(module: nn.Module) -> bool:
    return getattr(type(module), "_switchback_unfused_class", None) is not None


def sync_fused_mlps(model: nn.Module) -> int:
    """Fuse every block that qualifies, unfuse every fused block that no longer does; returns # fused."""
    fused = 0
    for module in model.modules():
        kind = _qualifies(module)
        if kind is not None:
            if not is_fused_mlp(module):
                # A subclass of the module's own class that only adds a forward: the instance (Parameters, hooks,
                # fully_shard's state) is untouched, and no other library's private state is read or written.
                module.__class__ = _fused_class(type(module))
            setattr(module, _ACTIVATION_ATTR, (kind, type(module.activation_fn)))
            fused += 1
        elif is_fused_mlp(module) and type(module) is _fused_class(_unfused_class(module)):
            # (A class derived from ours later, e.g. by fully_shard, is left as is: its forward falls back.)
            module.__class__ = _unfused_class(module)
            module.__dict__.pop(_ACTIVATION_ATTR, None)
    return fused


__all__ = ["activation_kind", "is_fused_mlp", "quantized_input_config", "sync_fused_mlps"]
