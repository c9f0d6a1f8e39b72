"""Inference mode: quantize every SwitchBack weight once, then serve no-grad forwards from that cache.

In training, SwitchBack re-quantizes the weight at every call because the optimizer changes it at every
step. For evaluation and serving the weight is constant, so `prepare_for_inference` quantizes it once
(8-bit copy + scales, kept as non-persistent buffers: not in state_dict, not in checkpoints) and each
no-grad forward only quantizes its input. `restore_training` drops the cache. Forwards with grad enabled
always take the training path, so a prepared model still trains correctly (the cache is then ignored).

    prepare_for_inference(model)
    with torch.inference_mode():
        emb = model.get_image_features(pixel_values=...)
    restore_training(model)

or, scoped: `with switchback_inference(model): ...`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .functional import check_input, quantize_weight, quantized_dtypes, token_floor
from .kernels.backends import get_kernels

logger = logging.getLogger(__name__)

WEIGHT_Q = "_inference_weight_q"  # (N, K) int8 / float8_e4m3fn
WEIGHT_SCALE = "_inference_weight_scale"  # (N,) or () float32
_WEIGHT_KEY = "_inference_weight_key"  # identity of the weight the cache was built from (staleness check)


def _weight_key(weight: torch.Tensor) -> tuple:
    # data_ptr catches `.to()` / reloads (new storage); _version catches in-place updates (optimizer.step()).
    return (weight.data_ptr(), weight._version, weight.dtype, weight.device)


def _switchback_layers(model: nn.Module) -> list[nn.Module]:
    from .modules import SwitchBackLinear  # local: modules imports this file for cached_linear

    return [m for m in model.modules() if isinstance(m, SwitchBackLinear)]


def quantize_weight_cache(layer: nn.Module) -> None:
    """Quantize `layer.weight` once, as the forward of its config would, and keep it as buffers."""
    cfg = layer.switchback_config
    qdtype, _ = quantized_dtypes(cfg)
    kernels = get_kernels(cfg.backend, layer.weight.device)
    with torch.no_grad():
        w_q, w_scale = quantize_weight(kernels, layer.weight.detach(), cfg.weight_scaling, qdtype)
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
    check_input(
        x, weight
    )  # same errors as the training path (TypeError for integer input, nn.Linear's shape error)
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
    kernels = get_kernels(cfg.backend, x.device)
    x_q, x_scale = kernels.quantize_rowwise(x2d.contiguous(), qdtype)
    w_q, w_scale = layer._buffers[WEIGHT_Q], layer._buffers[WEIGHT_SCALE]
    out = kernels.scaled_matmul(x_q, w_q, x_scale, w_scale, bias, x.dtype)
    return out.reshape(*leading, weight.shape[0])


def prepare_for_inference(model: nn.Module) -> nn.Module:
    """Quantize every SwitchBackLinear weight of `model` once and switch to eval(); returns `model`.

    Call it after moving/casting the model (the cache follows `.to(device)`, but a dtype cast of the model
    would cast fp8 caches too; a changed weight is detected and raises). Costs one 8-bit copy of each
    swapped weight on top of the 16-bit one. Raises ValueError when the model has no SwitchBack layers.
    """
    layers = _switchback_layers(model)
    if not layers:
        raise ValueError(
            "prepare_for_inference: the model has no SwitchBackLinear layers (apply_switchback first)"
        )
    for layer in layers:
        quantize_weight_cache(layer)
    model.eval()
    logger.info("hf_switchback: %d SwitchBack weights quantized for inference", len(layers))
    return model


def restore_training(model: nn.Module, *, mode: bool = True) -> nn.Module:
    """Undo prepare_for_inference: drop every weight cache and call `model.train(mode)`; returns `model`."""
    for layer in _switchback_layers(model):
        drop_weight_cache(layer)
    return model.train(mode)


@contextlib.contextmanager
def switchback_inference(model: nn.Module) -> Iterator[nn.Module]:
    """`with switchback_inference(model):` prepared inside, back to the previous train/eval mode after."""
    was_training = model.training
    prepare_for_inference(model)
    try:
        yield model
    finally:
        restore_training(model, mode=was_training)


__all__ = [
    "cached_linear",
    "has_weight_cache",
    "prepare_for_inference",
    "restore_training",
    "switchback_inference",
]
