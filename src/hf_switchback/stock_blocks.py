"""The transformers CLIP / SigLIP block classes whose stock forward our generated subclasses reproduce (blocks/mlp.py,
blocks/attention.py, blocks/encoder_layer.py): looked up once, for the models this transformers has."""

from __future__ import annotations

import functools
import importlib

# transformers model module -> the prefix of its class names
_MODELS = (("clip", "CLIP"), ("siglip", "Siglip"), ("siglip2", "Siglip2"))


@functools.cache
def stock_classes(block: str) -> dict[str, type]:
    """Model module ("clip", "siglip", "siglip2") -> its class `<prefix><block>` (block "MLP": CLIPMLP, ...)."""
    classes = {}
    for module, prefix in _MODELS:
        try:
            modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
            classes[module] = getattr(modeling, prefix + block)
        except (ImportError, AttributeError):
            continue
    return classes


def runs_stock_forward(cls: type, block: str) -> bool:
    """Whether `cls` is one of the stock `block` classes, or a subclass that keeps its forward."""
    return any(issubclass(cls, c) and cls.forward is c.forward for c in stock_classes(block).values())


__all__ = ["runs_stock_forward", "stock_classes"]
