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

With `config.fuse_norm` or `fuse_activation` (and fuse_mlp off) the block's class is swapped too, and its
forward runs fc1's SwitchBack op, the activation and fc2 as the stock forward does, so that fc1 can take its
input's 8-bit form as `quantized_input` when the LayerNorm before it wrote that form (blocks/encoder_layer.py)
and, with fuse_activation, the activation writes fc2's 8-bit input in the same kernel; where fc1 runs its 8-bit
path too, fc1 and the activation are one backward node whose activation backward also writes fc1's 8-bit output
gradient (blocks/linear_activation.py), else the activation alone (blocks/producers.py).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..functional import runs_8bit, switchback_linear, switchback_mlp
from ..modules import SwitchBackLinear, is_plain_layer
from ..stock_blocks import runs_stock_forward
from ..weight_cache import has_weight_cache
from ..weight_operands import operands_for
from .linear_activation import switchback_linear_activation
from .producers import activation_quantize

# Instance attribute set on blocks of our class: (activation name for the kernels or None, type of activation_fn
# at fuse time, whether fc1 -> act -> fc2 runs as one op).
ACTIVATION_ATTR = "_switchback_activation"
# Class attribute of the generated subclasses: the class they were made from.
UNFUSED_ATTR = "_switchback_unfused_class"


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


def _unfused_class(module: nn.Module) -> type:
    return getattr(type(module), UNFUSED_ATTR, type(module))


def _qualifies(module: nn.Module) -> tuple[str | None, bool] | None:
    """(activation kind or None, whole) if `module` is a stock CLIPMLP whose fc1 and fc2 are SwitchBack and whose
    forward this module runs: whole=True for fc1 -> act -> fc2 as one op (fuse_mlp), False for the layers' own
    ops with the 8-bit inputs their producers write (fuse_norm before fc1, fuse_activation before fc2)."""
    base = _unfused_class(module)
    # the transformers MLP blocks whose forward is exactly fc2(activation_fn(fc1(x)))
    if not runs_stock_forward(base, "MLP"):
        return None
    fc1, fc2 = getattr(module, "fc1", None), getattr(module, "fc2", None)
    if not (isinstance(fc1, SwitchBackLinear) and isinstance(fc2, SwitchBackLinear)):
        return None
    cfg = fc1.switchback_config
    kind = activation_kind(module.activation_fn)
    # Config equality leaves kernel_options out (same numerics): a fused block runs with fc1's.
    if cfg.fuses_mlp and fc2.switchback_config == cfg and kind is not None:
        return kind, True
    if cfg.fuse_norm or (cfg.fuse_activation and kind is not None):
        return kind, False
    return None


def _fused_config(module: nn.Module):
    """The SwitchBackConfig with which `module` (a block of our class) runs its own forward right now, else None
    (then the stock forward runs)."""
    fc1, fc2 = module.fc1, module.fc2
    _, act_type, whole = getattr(module, ACTIVATION_ATTR)
    cfg = fc1.switchback_config if isinstance(fc1, SwitchBackLinear) else None
    # Inference mode (prepare_for_inference) serves no-grad forwards from the layers' weight caches.
    if cfg is None or has_weight_cache(fc1):
        return None
    if not whole:
        # fc1's op replaces fc1's forward: only where that forward is exactly it
        return (
            cfg
            if (cfg.fuse_norm or cfg.fuse_activation) and not cfg.fuses_mlp and is_plain_layer(fc1)
            else None
        )
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
    if type(module) is not FUSED_CLASSES.get(_unfused_class(module)):
        return None
    cfg = _fused_config(module)
    return cfg if cfg is not None and cfg.fuse_norm else None


def activation_feeds_fc2(module: nn.Module, cfg, x: torch.Tensor) -> str | None:
    """The activation kind when the activation should write fc2's 8-bit input right now (fuse_activation, fc2 a
    plain layer of the same config running its 8-bit path for the block's input x), else None."""
    kind, act_type, _ = getattr(module, ACTIVATION_ATTR)
    fc2 = module.fc2
    if (
        not cfg.fuse_activation
        or kind is None
        or type(module.activation_fn) is not act_type
        or not is_plain_layer(fc2)
    ):
        return None
    fc2_cfg = fc2.switchback_config
    if not (fc2_cfg is cfg or fc2_cfg == cfg) or not runs_8bit(
        fc2_cfg, x, (fc2.in_features, fc2.out_features)
    ):
        return None
    return kind


def _fused_forward(
    self,
    hidden_states: torch.Tensor,
    *,
    quantized_input: tuple[torch.Tensor, torch.Tensor] | None = None,
    checked_config=None,
) -> torch.Tensor:
    # checked_config: what quantized_input_config just returned for this block (passed on by the encoder layer,
    # as in blocks/attention.py)
    cfg = checked_config if checked_config is not None else _fused_config(self)
    if cfg is None:
        # (a quantized_input is only ever the LayerNorm output's 8-bit form: dropping it changes nothing)
        return getattr(self, UNFUSED_ATTR).forward(self, hidden_states)
    if not cfg.fuse_norm:
        quantized_input = None
    fc1, fc2 = self.fc1, self.fc2
    kind, _, whole = getattr(self, ACTIVATION_ATTR)
    # the cached weight operands: the 8-bit path runs where the LayerNorm wrote the input's 8-bit form, else
    # operands_for asks the token floor
    probe = hidden_states if quantized_input is None else None
    if whole:
        operands = (operands_for(fc1, probe), operands_for(fc2, probe))
        return switchback_mlp(
            hidden_states,
            fc1.weight,
            fc1.bias,
            fc2.weight,
            fc2.bias,
            kind,
            cfg,
            quantized_input=quantized_input,
            weight_operands=None if None in operands else operands,
        )
    kind = activation_feeds_fc2(self, cfg, hidden_states)
    if kind is not None and runs_8bit(cfg, hidden_states, (fc1.in_features, fc1.out_features)):
        # fc1 and the activation as one backward node: the activation's backward writes fc1's 8-bit gradient
        a, a_quantized = switchback_linear_activation(
            hidden_states,
            fc1.weight,
            fc1.bias,
            kind,
            cfg,
            quantized_input=quantized_input,
            weight_operands=operands_for(fc1),
        )
        return switchback_linear(
            a,
            fc2.weight,
            fc2.bias,
            fc2.switchback_config,
            quantized_input=a_quantized,
            weight_operands=operands_for(fc2),
        )
    operands = operands_for(fc1, probe)
    h = switchback_linear(
        hidden_states, fc1.weight, fc1.bias, cfg, quantized_input=quantized_input, weight_operands=operands
    )
    if kind is None:
        return fc2(self.activation_fn(h))
    a, a_quantized = activation_quantize(h, kind, cfg)
    operands = operands_for(fc2)
    return switchback_linear(
        a, fc2.weight, fc2.bias, fc2.switchback_config, quantized_input=a_quantized, weight_operands=operands
    )


# unfused class -> its generated subclass, as _fused_class made them (read per call: see blocks/attention.py)
FUSED_CLASSES: dict[type, type] = {}


@functools.cache
def _fused_class(base: type) -> type:
    fused = type(
        f"SwitchBack{base.__name__}",
        (base,),
        {"forward": _fused_forward, UNFUSED_ATTR: base, "__module__": __name__},
    )
    FUSED_CLASSES[base] = fused
    return fused


def is_fused_mlp(module: nn.Module) -> bool:
    """True when `module` runs fc1 -> act -> fc2 as one op (our class, fuse_mlp): not for a block of our class that
    runs the layers' own ops with their producers' 8-bit inputs (fuse_norm, fuse_activation)."""
    return _has_our_class(module) and getattr(module, ACTIVATION_ATTR, (None, None, False))[2]


def _has_our_class(module: nn.Module) -> bool:
    return getattr(type(module), UNFUSED_ATTR, None) is not None


def sync_fused_mlps(model: nn.Module) -> int:
    """Give every block that qualifies our class (fused, or running its layers' ops with their producers' 8-bit
    inputs), every block of ours that no longer qualifies its class back; returns the number fused (one op)."""
    fused = 0
    for module in model.modules():
        qualified = _qualifies(module)
        if qualified is not None:
            if not _has_our_class(module):
                # A subclass of the module's own class that only adds a forward: the instance (Parameters, hooks,
                # fully_shard's state) is untouched, and no other library's private state is read or written.
                module.__class__ = _fused_class(type(module))
            kind, whole = qualified
            setattr(module, ACTIVATION_ATTR, (kind, type(module.activation_fn), whole))
            fused += whole
        elif _has_our_class(module) and type(module) is _fused_class(_unfused_class(module)):
            # (A class derived from ours later, e.g. by fully_shard, is left as is: its forward falls back.)
            module.__class__ = _unfused_class(module)
            module.__dict__.pop(ACTIVATION_ATTR, None)
    return fused


__all__ = [
    "ACTIVATION_ATTR",
    "activation_feeds_fc2",
    "activation_kind",
    "is_fused_mlp",
    "quantized_input_config",
    "sync_fused_mlps",
]
