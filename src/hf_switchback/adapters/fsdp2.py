"""FSDP2 (torch.distributed.fsdp.fully_shard): retarget its per-parameter module records after a module swap.

Checked against torch 2.13's `torch.distributed.fsdp._fully_shard` (`FSDPModule._get_fsdp_state`,
`FSDPState._fsdp_param_groups`, `FSDPParam._module_info`); releases from before per-parameter meshes kept one
group as `FSDPState._fsdp_param_group`, which is read when the list is absent.
"""

from __future__ import annotations

from torch import nn

_BROKEN = (
    "FSDP2's private layout changed in this torch version ({what} is missing), so hf_switchback cannot point "
    "fully_shard's records at the swapped layers. Apply SwitchBack before fully_shard (with accelerate: "
    "before accelerator.prepare), or use a torch version in the range pyproject.toml names."
)


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    # The one-group layout (torch 2.13 still offers it as a backward-compatible property); None: no parameters.
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise RuntimeError(_BROKEN.format(what="FSDPState._fsdp_param_groups"))


def retarget_fsdp_modules(model: nn.Module, replaced: dict[int, nn.Module]) -> None:
    """Point fully_shard's records of each replaced module (id(old) -> new) at its replacement.

    fully_shard stores, per parameter, the module it setattr()s the gathered / re-sharded tensor on
    (`FSDPParam._module_info.module` and `.shared_modules`). A swap that reuses the Parameters must update
    them, or FSDP keeps writing into the detached module and the new one computes with the sharded DTensors
    ("got mixed torch.Tensor and DTensor"). torch has no public API to re-register a module under an existing
    fully_shard; re-running fully_shard would re-shard already sharded parameters. A no-op for models without
    fully_shard; RuntimeError when a sharded model's records are not where this torch version was expected to
    keep them.
    """
    try:
        from torch.distributed.fsdp import FSDPModule  # public since torch 2.6; fully_shard makes modules one
    except ImportError:  # a torch build without distributed support has no fully_shard models
        return
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            raise RuntimeError(_BROKEN.format(what="FSDPModule._get_fsdp_state"))
        for group in _param_groups(get_state()):
            for fsdp_param in group.fsdp_params:
                info = getattr(fsdp_param, "_module_info", None)
                if info is None or not hasattr(info, "module") or not hasattr(info, "shared_modules"):
                    raise RuntimeError(_BROKEN.format(what="FSDPParam._module_info.module / .shared_modules"))
                info.module = replaced.get(id(info.module), info.module)
                info.shared_modules = [replaced.get(id(m), m) for m in info.shared_modules]


__all__ = ["retarget_fsdp_modules"]
