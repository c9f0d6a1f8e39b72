"""apply_switchback / remove_switchback: swap nn.Linear <-> SwitchBackLinear in place.

Target matching follows PEFT, which users already know: a str is a regex that must fully match the dotted
module name; a list matches exact names or dotted suffixes ("fc1" matches "...mlp.fc1"). Everything is
validated before the first module is replaced, so a failure never leaves a model half converted.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from torch import nn

from .adapters.fsdp2 import retarget_fsdp_modules
from .blocks.attention import sync_fused_attention
from .blocks.encoder_layer import sync_fused_layers
from .blocks.mlp import sync_fused_mlps
from .blocks.multihead_attention import (
    find_multihead_attention,
    restore_multihead_attention,
    swap_multihead_attention,
)
from .config import SwitchBackConfig
from .kernels.backends import check_backend
from .modules import SwitchBackLinear
from .precision_summary import precision_summary
from .weight_cache import drop_weight_cache
from .weight_operands import sync_weight_operands

logger = logging.getLogger(__name__)

FilterFn = Callable[[str, nn.Module], bool]


def name_matches(name: str, spec: str | tuple[str, ...] | None) -> bool:
    """PEFT semantics: str -> re.fullmatch; sequence -> exact name or dotted suffix; None -> nothing."""
    if spec is None:
        return False
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return any(name == t or name.endswith("." + t) for t in spec)


def _replace_submodules(model: nn.Module, replacements: dict[str, nn.Module]) -> None:
    """setattr each dotted name to its new module, then fix FSDP2's records once for all of them."""
    replaced = {}
    for name, module in replacements.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        replaced[id(getattr(parent, child))] = module
        setattr(parent, child, module)
    if replaced:
        retarget_fsdp_modules(model, replaced)


def find_targets(model: nn.Module, config: SwitchBackConfig, filter_fn: FilterFn | None = None) -> list[str]:
    """Dotted names of the nn.Linear modules `config` (and filter_fn) select, in model order.

    Already-swapped SwitchBackLinear modules are included (so applying twice is idempotent); raise
    ValueError naming some of the linears seen when nothing matches.
    """
    linear_names, selected = [], []
    # nn.MultiheadAttention reads out_proj.weight directly and never calls out_proj's forward: a swap there
    # would be reported but silently run in 16-bit, so those linears are never targets.
    mha_children = {
        f"{name}.out_proj" if name else "out_proj"
        for name, m in model.named_modules()
        if isinstance(m, nn.MultiheadAttention)
    }
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name in mha_children:
            continue
        if name == "":
            raise TypeError(
                "apply_switchback: the model itself is an nn.Linear; use SwitchBackLinear.from_linear(linear, config)"
            )
        linear_names.append(name)
        if not name_matches(name, config.target_modules) or name_matches(name, config.exclude_modules):
            continue
        if filter_fn is not None and not filter_fn(name, module):
            continue
        selected.append(name)
    if not selected:
        seen = ", ".join(linear_names[:8]) + (", ..." if len(linear_names) > 8 else "")
        raise ValueError(
            f"apply_switchback: no nn.Linear matched target_modules={config.target_modules!r} "
            f"(exclude_modules={config.exclude_modules!r}). The model has {len(linear_names)} linear layers"
            + (f", e.g. {seen}" if linear_names else "")
            + ". Pass SwitchBackConfig(target_modules=[...]) with names or dotted suffixes from that list."
        )
    return selected


def apply_switchback(
    model: nn.Module, config: SwitchBackConfig | None = None, *, filter_fn: FilterFn | None = None
) -> nn.Module:
    """Replace the selected nn.Linear layers of `model` by SwitchBackLinear, in place; returns `model`.

    config defaults to SwitchBackConfig() (every q/k/v/out_proj, fc1, fc2 of a CLIP model; projections
    excluded). filter_fn(name, module) -> bool narrows the selection further. Parameters are reused, not
    copied.

    Calling it again on a model that already has SwitchBack layers reconfigures: every swapped layer gets the
    new config (no double wrapping), and newly selected linears are swapped too. The new selection must cover
    every layer swapped before: a narrower one (fewer target_modules, more exclude_modules, a stricter
    filter_fn) raises ValueError naming those layers and changes nothing, rather than leaving them on the old
    config. To narrow, call remove_switchback(model) first, then apply_switchback with the new config.
    """
    config = config or SwitchBackConfig()
    if not isinstance(config, SwitchBackConfig):
        raise TypeError(f"apply_switchback: config must be a SwitchBackConfig, got {type(config).__name__}")
    check_backend(config.backend)
    targets = find_targets(model, config, filter_fn)
    left_out = sorted(set(switchback_modules(model)) - set(targets))
    if left_out:
        shown = ", ".join(left_out[:4]) + (", ..." if len(left_out) > 4 else "")
        raise ValueError(
            f"apply_switchback: {len(left_out)} layers already use SwitchBack but this call does not select them "
            f"({shown}), so they would keep their old config. Select them too, or call remove_switchback(model) "
            "first and then apply_switchback with the narrower config."
        )

    # nn.MultiheadAttention (OpenCLIP's attention) is selected by its own name, e.g. "attn"; validated here,
    # before anything is swapped.
    attention = find_multihead_attention(
        model,
        lambda name, module: (
            name_matches(name, config.target_modules)
            and not name_matches(name, config.exclude_modules)
            and (filter_fn is None or filter_fn(name, module))
        ),
    )

    replacements = {}
    for name in targets:
        module = model.get_submodule(name)
        if isinstance(module, SwitchBackLinear):
            module.switchback_config = config
            drop_weight_cache(module)  # an inference cache built under the old config no longer applies
        else:
            replacements[name] = SwitchBackLinear.from_linear(module, config)
    _replace_submodules(model, replacements)
    swap_multihead_attention(model, config, attention)

    fused = sync_fused_mlps(model)
    fused_qkv = sync_fused_attention(model)  # (blocks whose q/k/v run as one op)
    fused_norms = sync_fused_layers(model)
    sync_weight_operands(model, list(switchback_modules(model)))
    logger.info(
        "hf_switchback: %d linear layers use SwitchBack %s (%d MLP blocks fused, %d q/k/v fused, %d encoder "
        "layers quantizing in their LayerNorms)",
        len(targets),
        config.variant,
        fused,
        fused_qkv,
        fused_norms,
    )
    # What runs 8-bit on this device and why the rest does not: "switchback=int8" alone would overclaim.
    logger.info(precision_summary(model))
    return model


def remove_switchback(model: nn.Module) -> nn.Module:
    """Turn every SwitchBackLinear of `model` back into nn.Linear with the same Parameters (and fused MLP
    blocks back into their original class); returns `model`."""
    names = [name for name, m in model.named_modules() if isinstance(m, SwitchBackLinear)]
    if isinstance(model, SwitchBackLinear):
        raise TypeError("remove_switchback: call .to_linear() on a bare SwitchBackLinear")
    _replace_submodules(model, {name: model.get_submodule(name).to_linear() for name in names})
    restore_multihead_attention(model)
    sync_fused_mlps(model)  # no block qualifies any more: every fused block gets its original class back
    sync_fused_attention(model)
    sync_fused_layers(model)
    sync_weight_operands(model, [])
    return model


def switchback_modules(model: nn.Module) -> dict[str, SwitchBackLinear]:
    """The SwitchBackLinear modules of `model` by dotted name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, SwitchBackLinear)}


__all__ = ["apply_switchback", "find_targets", "name_matches", "remove_switchback", "switchback_modules"]
