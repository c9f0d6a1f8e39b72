"""transformers integration: SwitchBack as a registered quantization method ("switchback").

After `import hf_switchback`:

    model = CLIPModel.from_pretrained(path, quantization_config=SwitchBackConfig(weight_scaling="row"))

builds the model on the meta device, swaps the selected nn.Linear for SwitchBackLinear before any weight
is read (no extra copy), then loads the checkpoint's 16-bit weights into them unchanged. SwitchBack keeps
weights in 16 bit and quantizes on the fly, so checkpoints are plain safetensors with the plain model's keys
and dtypes; config.json only gains `quantization_config` ({"quant_method": "switchback", ...}).

Reloading such a checkpoint with hf_switchback imported restores SwitchBack. Without it, transformers
(5.x, `AutoHfQuantizer.supports_quant_method`) logs "Unknown quantization type ... we will skip the
quantization" and loads a plain, working model; `strip_quantization_config` publishes without the entry.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from torch import nn
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from .config import QUANT_METHOD, SwitchBackConfig
from .convert import apply_switchback, find_targets, remove_switchback
from .interop import check_accelerate_fp8, foreign_linears
from .kernels.backends import check_backend

logger = logging.getLogger(__name__)


class SwitchBackQuantizationConfig(QuantizationConfigMixin):
    """The registry entry for "switchback": turns config.json's dict into a SwitchBackConfig.

    transformers' registry accepts only QuantizationConfigMixin subclasses, but that mixin is a mutable
    dataclass with a required `quant_method` field, which a frozen SwitchBackConfig cannot inherit. Past
    the registry transformers only reads `.quant_method` and calls `.to_dict()`, which SwitchBackConfig has,
    so this class only loads: `from_dict` returns a SwitchBackConfig. Users never see it, and reloading with
    the config passed again does not trip transformers' "different config class" check.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Use hf_switchback.SwitchBackConfig(...) as the quantization_config.")

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        config = SwitchBackConfig.from_dict(config_dict)
        return (config, kwargs) if return_unused_kwargs else config


def as_switchback_config(config: SwitchBackConfig | dict[str, Any]) -> SwitchBackConfig:
    """SwitchBackConfig from itself or its to_dict() form (config.json)."""
    if isinstance(config, SwitchBackConfig):
        return config
    if isinstance(config, dict):
        return SwitchBackConfig.from_dict(config)
    raise TypeError(f"expected a SwitchBackConfig or its dict form, got {type(config).__name__}")


class SwitchBackHfQuantizer(HfQuantizer):
    """HfQuantizer for SwitchBack: swaps modules before loading; weights load as they are (16-bit)."""

    requires_calibration = False

    def __init__(self, quantization_config: SwitchBackConfig | dict[str, Any], **kwargs: Any) -> None:
        super().__init__(as_switchback_config(quantization_config), **kwargs)

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        # Fail in from_pretrained, not at the first forward: a missing Triton or an fp8 clash is a setup error.
        check_backend(self.quantization_config.backend)
        check_accelerate_fp8()

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        # The model lives on the meta device here: from_linear re-wraps the (meta) Parameters, and the loader
        # then fills them from the checkpoint under the same names.
        foreign = foreign_linears(model)
        targets = set(find_targets(model, self.quantization_config))
        clash = sorted(targets & set(foreign))
        if clash:
            raise RuntimeError(f"SwitchBack targets are already quantized by another library: {clash[:4]}")
        # Honour the model's own full-precision list, as every transformers quantizer does.
        keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
        filter_fn = (
            (lambda name, _m: not any(name == k or name.startswith(k + ".") for k in keep)) if keep else None
        )
        apply_switchback(model, self.quantization_config, filter_fn=filter_fn)
        return model

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        return model

    def _dequantize(self, model: nn.Module, dtype=None) -> nn.Module:
        # model.dequantize(): back to plain nn.Linear (same Parameters); the base class drops the config.
        return remove_switchback(model)

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        # Weights stay plain 16-bit tensors: the standard safetensors writer is all it takes.
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        # Lets Trainer fine-tune every weight (no adapters needed): SwitchBack *is* quantized training.
        return True

    @property
    def is_compileable(self) -> bool:
        return True


def register() -> None:
    """Register "switchback" with transformers; idempotent (a module reload must not raise)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(SwitchBackQuantizationConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(SwitchBackHfQuantizer)


def strip_quantization_config(model_or_dir: nn.Module | str | os.PathLike) -> None:
    """Drop SwitchBack's quantization_config so a checkpoint reads as a plain model everywhere.

    Pass a model (before save_pretrained: its config and hf_quantizer are cleared, its layers are left as
    they are; `model.dequantize()` also turns them back into nn.Linear) or a save_pretrained directory
    (config.json is rewritten). The weights need no change.
    """
    if isinstance(model_or_dir, nn.Module):
        quantizer = getattr(model_or_dir, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model_or_dir)
        elif getattr(getattr(model_or_dir, "config", None), "quantization_config", None) is not None:
            del model_or_dir.config.quantization_config
        return
    _set_quantization_config(model_or_dir, None)


def write_quantization_config(folder: str | os.PathLike, config: SwitchBackConfig) -> None:
    """Record `config` as quantization_config in a save_pretrained directory's config.json, so the checkpoint
    reloads as SwitchBack under hf_switchback (and as a plain model elsewhere). A model converted with
    apply_switchback rather than from_pretrained saves without it; every save path of this package calls this."""
    _set_quantization_config(folder, as_switchback_config(config).to_dict())


def _set_quantization_config(folder: str | os.PathLike, entry: dict[str, Any] | None) -> None:
    path = os.path.join(os.fspath(folder), "config.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if entry is None and "quantization_config" not in data:
        return
    data.pop("quantization_config", None)
    if entry is not None:
        data["quantization_config"] = entry
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


register()

__all__ = [
    "SwitchBackHfQuantizer",
    "SwitchBackQuantizationConfig",
    "as_switchback_config",
    "register",
    "strip_quantization_config",
    "write_quantization_config",
]
