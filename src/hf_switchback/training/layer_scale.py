"""Learnable per-channel layer-scale on the residual branches of HF CLIP encoder layers.

Each `CLIPEncoderLayer` computes ``h = h + attn(ln1(h))`` and ``h = h + mlp(ln2(h))``. Layer-scale multiplies
each branch output by a learnable vector ``γ`` (one value per channel) before the residual add. With ``γ = 0``
(the SwitchBack paper's zero-init, §2.3) every layer starts as the identity, which keeps features small early in
training, and small features are what fp8/int8 quantization needs.

How it attaches: a `LayerScale` module is added to each encoder layer as ``layer_scale1`` (attention) and
``layer_scale2`` (MLP), and a forward hook on ``self_attn`` / ``mlp`` applies it to their output. Hooking the
containers (not ``out_proj`` / ``fc2``) keeps every original module name and state-dict key unchanged, so
`apply_switchback` / `remove_switchback` work in either order and a checkpoint still loads into CLIPModel after
folding; no ``forward`` is replaced.

Folding: ``γ ⊙ (W x + b) = (diag(γ) W) x + γ ⊙ b``, so `fold_layer_scale` multiplies the rows of
``out_proj.weight`` / ``fc2.weight`` and their biases by ``γ`` and removes the modules and hooks; the model is
then a plain CLIPModel with the same outputs. `fold_layer_scale_state_dict` does the same on a state dict (e.g.
``accelerator.get_state_dict(model)``) without touching the training model.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.clip.modeling_clip import CLIPEncoderLayer
from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

__all__ = [
    "LayerScale",
    "add_layer_scale",
    "fold_layer_scale",
    "fold_layer_scale_state_dict",
    "has_layer_scale",
]

# Branch container -> (layer-scale attribute on the encoder layer, output projection inside the container).
_BRANCHES = {"self_attn": ("layer_scale1", "out_proj"), "mlp": ("layer_scale2", "fc2")}


class LayerScale(nn.Module):
    """``x * scale`` over the last (channel) dimension; ``scale`` has shape ``(dim,)`` and starts at ``init``."""

    def __init__(self, dim: int, init: float = 0.0, *, device=None, dtype=None):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), float(init), device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def extra_repr(self) -> str:
        return f"dim={self.scale.numel()}"


class _ScaleBranchOutput:
    """Forward hook applying a layer's LayerScale to its branch output.

    A small object rather than a closure so that `copy.deepcopy(model)` (and pickling) maps the reference onto the
    copied LayerScale along with the module tree.
    """

    def __init__(self, layer_scale: LayerScale):
        self.layer_scale = layer_scale

    def __call__(self, module: nn.Module, args, output):
        # CLIPAttention returns (attn_output, attn_weights); CLIPMLP returns the tensor.
        if isinstance(output, tuple):
            return (self.layer_scale(output[0]), *output[1:])
        return self.layer_scale(output)


# SigLIP's encoder layer has CLIP's layout (self_attn.out_proj, mlp.fc2, the same residual adds).
_ENCODER_LAYERS = (CLIPEncoderLayer, SiglipEncoderLayer)


def _encoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = [m for m in model.modules() if isinstance(m, _ENCODER_LAYERS)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no CLIPEncoderLayer to add layer-scale to")
    return layers


def has_layer_scale(model: nn.Module) -> bool:
    """True if `add_layer_scale` was applied and not yet folded."""
    return any(isinstance(m, LayerScale) for m in model.modules())


def add_layer_scale(model: nn.Module, init: float = 0.0) -> nn.Module:
    """Add a learnable per-channel layer-scale (value ``init``) to both residual branches of every CLIP encoder
    layer of ``model`` (CLIPModel, CLIPVisionModel, CLIPTextModel, ...), in place; returns ``model``.

    Call it before creating the optimizer (the scales are new Parameters) and before `accelerator.prepare`.
    The scales take the dtype/device of each layer's ``out_proj`` / ``fc2`` weight.
    """
    if has_layer_scale(model):
        raise ValueError("model already has layer-scale; fold_layer_scale(model) first")
    for layer in _encoder_layers(model):
        for branch_name, (scale_name, proj_name) in _BRANCHES.items():
            branch = getattr(layer, branch_name)
            weight = getattr(branch, proj_name).weight
            ls = LayerScale(weight.shape[0], init, device=weight.device, dtype=weight.dtype)
            layer.add_module(scale_name, ls)
            branch.register_forward_hook(_ScaleBranchOutput(ls))
    return model


@torch.no_grad()
def fold_layer_scale(model: nn.Module) -> nn.Module:
    """Fold every layer-scale into its ``out_proj`` / ``fc2`` weight and bias and remove it, in place.

    Afterwards ``model`` has exactly the modules and state-dict keys of the model before `add_layer_scale` and
    the same outputs (up to one float rounding of ``γ·W``). Works for nn.Linear and SwitchBackLinear projections,
    whose Parameters are scaled in place (optimizer references to them stay valid).
    """
    for layer in _encoder_layers(model):
        for branch_name, (scale_name, proj_name) in _BRANCHES.items():
            ls = getattr(layer, scale_name, None)
            if ls is None:
                continue
            branch = getattr(layer, branch_name)
            proj = getattr(branch, proj_name)
            scale = ls.scale.detach().to(proj.weight.dtype)
            proj.weight.mul_(scale[:, None])
            if proj.bias is not None:
                proj.bias.mul_(scale)
            for hook_id, hook in list(branch._forward_hooks.items()):
                if isinstance(hook, _ScaleBranchOutput) and hook.layer_scale is ls:
                    del branch._forward_hooks[hook_id]
            delattr(layer, scale_name)
    return model


@torch.no_grad()
def fold_layer_scale_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return a copy of ``state_dict`` with the layer-scales folded and their keys removed (input untouched).

    For saving a plain-CLIPModel checkpoint mid-training, e.g. from ``accelerator.get_state_dict(model)``:
    keys ``<layer>.layer_scale1.scale`` fold into ``<layer>.self_attn.out_proj.{weight,bias}`` and
    ``<layer>.layer_scale2.scale`` into ``<layer>.mlp.fc2.{weight,bias}``.
    """
    out = dict(state_dict)
    for branch_name, (scale_name, proj_name) in _BRANCHES.items():
        suffix = f".{scale_name}.scale"
        for key in [k for k in state_dict if k.endswith(suffix)]:
            prefix = key[: -len(suffix)]
            scale = out.pop(key)
            weight_key = f"{prefix}.{branch_name}.{proj_name}.weight"
            if weight_key not in out:
                raise KeyError(f"{key} has no matching {weight_key} in the state dict")
            out[weight_key] = out[weight_key] * scale.to(out[weight_key].dtype)[:, None]
            bias_key = f"{prefix}.{branch_name}.{proj_name}.bias"
            if bias_key in out:
                out[bias_key] = out[bias_key] * scale.to(out[bias_key].dtype)
    return out
