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

from torch import nn

from .modules import SwitchBackLinear
from .weight_cache import drop_weight_cache, quantize_weight_cache

logger = logging.getLogger(__name__)


def _switchback_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, SwitchBackLinear)]


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
    "prepare_for_inference",
    "restore_training",
    "switchback_inference",
]
