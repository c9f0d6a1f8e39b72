"""What the SwitchBack layers of a model actually run on a device: 8-bit, or the 16-bit fallback and why.

A swapped layer runs its 8-bit path only from a token floor (functional.token_floor): config.min_tokens, or
on CUDA under backend="auto" the measured crossover of its shape (kernels/crossover), which can be "never".
So "switchback=int8" on a layer says what it may do, not what it does; this module says the latter, once at
apply time and in the training script's header. Off CUDA the floor is 0: every layer runs the torch
reference kernels (the same numerics, no speed-up).
"""

from __future__ import annotations

import torch
from torch import nn

from .functional import token_floor
from .kernels import crossover
from .modules import SwitchBackLinear

# Instance attribute that blocks/mlp.py sets on a block of its class: (activation kind, its type, whole); whole marks a
# fused fc1 -> act -> fc2 op, whose floor covers both shapes (else each layer keeps its own).
_FUSED_MLP_ATTR = "_switchback_activation"


def layer_floors(model: nn.Module, device: torch.device | str, compiled: bool = False) -> dict[str, int]:
    """{dotted name: token floor on `device`} of every SwitchBackLinear of `model`; `compiled`: the floors that
    apply under torch.compile (functional.token_floor).

    A layer of a fused MLP block gets the block's floor (the larger of fc1's and fc2's), as switchback_mlp does.
    """
    device = torch.device(device)
    floors = {}
    for name, module in model.named_modules():
        children = {n: m for n, m in module.named_children() if isinstance(m, SwitchBackLinear)}
        whole = getattr(module, _FUSED_MLP_ATTR, (None, None, False))[2]
        fused = whole and {"fc1", "fc2"} <= children.keys()
        for child_name, child in children.items():
            shapes = [(child.in_features, child.out_features)]
            if fused:
                shapes = [(m.in_features, m.out_features) for m in (children["fc1"], children["fc2"])]
            floors[f"{name}.{child_name}" if name else child_name] = token_floor(
                child.switchback_config, device, *shapes, compiled=compiled
            )
    return floors


def _fallback_reason(layers: list[SwitchBackLinear], device: torch.device) -> str:
    explicit = sorted({m.switchback_config.min_tokens for m in layers if m.switchback_config.min_tokens})
    if explicit:
        return f"min_tokens={', '.join(map(str, explicit))}"
    capability = crossover.cuda_capability(device.type, device.index)
    table = crossover.TABLE_DIR / crossover.table_name(capability)
    if table.exists():
        return f"the measured crossover, kernels/crossover/{table.name}"
    return f"no crossover table for {table.stem}: the default floor of {crossover.FALLBACK_MIN_TOKENS} tokens"


def precision_summary(model: nn.Module, device: torch.device | str | None = None) -> str:
    """One line: how many swapped layers run 8-bit on `device` (default: where the weights are, or the
    current CUDA device when the weights are not on one but CUDA is available), and why the rest do not."""
    modules = {n: m for n, m in model.named_modules() if isinstance(m, SwitchBackLinear)}
    if not modules:
        return "hf_switchback: no SwitchBack layers"
    if device is None:
        # weights on the CPU or the meta device (from_pretrained's swap) usually train on the GPU when there is one
        weights = next(iter(modules.values())).weight.device
        device = weights if weights.type == "cuda" else "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    floors = layer_floors(model, device)
    precisions = {m.switchback_config.precision for m in modules.values()}
    label = precisions.pop() if len(precisions) == 1 else "8-bit"
    if device.type != "cuda":
        where = f"{device.type} (torch reference kernels: the same numerics, no speed-up)"
    else:
        where = f"{device} ({torch.cuda.get_device_name(device)})"
    text = f"hf_switchback on {where}: {_describe(floors, label)}"
    compiled = layer_floors(model, device, compiled=True)
    if compiled != floors:  # the table holds thresholds measured under torch.compile that differ
        text += f"; under torch.compile: {_describe(compiled, label)}"
    if any(f > 0 for f in (*floors.values(), *compiled.values())):
        fallback = [modules[n] for n in floors if floors[n] > 0 or compiled[n] > 0]
        text += f"; floors from {_fallback_reason(fallback, device)}"
        # the library chose these floors (no min_tokens of the user's): say how to override them
        if not any(m.switchback_config.min_tokens for m in fallback):
            text += " (SwitchBackConfig(min_tokens=0) forces 8-bit)"
    return text


def _describe(floors: dict[str, int], label: str) -> str:
    """How many layers of `floors` run `label` always, from some token count, or never."""
    always = [n for n, f in floors.items() if f == 0]
    never = [n for n, f in floors.items() if f >= crossover.NEVER]
    above = [f for f in floors.values() if 0 < f < crossover.NEVER]
    parts = [f"{len(always)} of {len(floors)} swapped layers run {label} at any token count"]
    if above:
        span = f"{min(above)}" if min(above) == max(above) else f"{min(above)}-{max(above)}"
        parts.append(f"{len(above)} run {label} from {span} tokens per call and 16-bit below")
    if never:
        parts.append(f"{len(never)} always fall back to 16-bit ({label} never pays for their shapes)")
    return "; ".join(parts)


__all__ = ["layer_floors", "precision_summary"]
