"""The inference weight cache of one SwitchBackLinear: its weight quantized once, served to no-grad forwards.

inference.py turns it on and off for a whole model (prepare_for_inference / restore_training);
SwitchBackLinear.forward reads it. A leaf below both, so neither imports the other through it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .functional import check_input, quantize_weight, quantized_dtypes, token_floor
from .kernels.backends import get_kernels

WEIGHT_Q = "_inference_weight_q"  # (N, K) int8 / float8_e4m3fn
WEIGHT_SCALE = "_inference_weight_scale"  # (N,) or () float32
_WEIGHT_KEY = "_inference_weight_key"  # identity of the weight the cache was built from (staleness check)


def _weight_key(weight: torch.Tensor) -> tuple:
    # data_ptr catches `.to()` / reloads (new storage); _version catches in-place updates (optimizer.step()).
    return (weight.data_ptr(), weight._version, weight.dtype, weight.device)


def quantize_weight_cache(layer: nn.Module) -> None:
    """Quantize `layer.weight` once, as the forward of its config would, and keep it as buffers."""
    cfg = layer.switchback_config
    qdtype, _ = quantized_dtypes(cfg)
    options = cfg.kernel_options
    kernels = get_kernels(cfg.backend, layer.weight.device, options)
    with torch.no_grad():
        w_q, w_scale = quantize_weight(kernels, layer.weight.detach(), cfg.weight_scaling, qdtype, options)
    layer.register_buffer(WEIGHT_Q, w_q, persistent=False)
    layer.register_buffer(WEIGHT_SCALE, w_scale, persistent=False)
    setattr(layer, _WEIGHT_KEY, _weight_key(layer.weight))


def drop_weight_cache(layer: nn.Module) -> None:
    for name in (WEIGHT_Q, WEIGHT_SCALE):
        layer._buffers.pop(name, None)
    if hasattr(layer, _WEIGHT_KEY):
        delattr(layer, _WEIGHT_KEY)


def has_weight_cache(layer: nn.Module) -> bool:
    return layer._buffers.get(WEIGHT_Q) is not None


def cached_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """SwitchBack forward from the cached weight: only `x` is quantized. Called by SwitchBackLinear.forward
    under no_grad / inference_mode when the cache exists. x (*, K) float -> (*, N) in x's (autocast) dtype."""
    weight, bias, cfg = layer.weight, layer.bias, layer.switchback_config
    if getattr(layer, _WEIGHT_KEY) != _weight_key(weight):
        raise RuntimeError(
            "SwitchBackLinear: the weight changed (optimizer step, .to(), load) since prepare_for_inference(); "
            "call prepare_for_inference(model) again, or restore_training(model) to drop the stale cache."
        )
    # Same errors as the training path (TypeError for integer input, nn.Linear's shape error).
    check_input(x, weight)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        x = x.to(torch.get_autocast_dtype(device_type))
    leading = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[0] == 0 or x2d.shape[0] < token_floor(cfg, device_type):
        # Same small-batch fallback as the training path: the 16-bit matmul.
        out = F.linear(x2d, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return out.reshape(*leading, weight.shape[0])
    qdtype, _ = quantized_dtypes(cfg)
    options = cfg.kernel_options
    kernels = get_kernels(cfg.backend, x.device, options)
    x_q, x_scale = kernels.quantize_rowwise(x2d.contiguous(), qdtype, options=options)
    w_q, w_scale = layer._buffers[WEIGHT_Q], layer._buffers[WEIGHT_SCALE]
    out = kernels.scaled_matmul(x_q, w_q, x_scale, w_scale, bias, x.dtype, options=options)
    return out.reshape(*leading, weight.shape[0])


__all__ = [
    "WEIGHT_Q",
    "WEIGHT_SCALE",
    "cached_linear",
    "drop_weight_cache",
    "has_weight_cache",
    "quantize_weight_cache",
]
