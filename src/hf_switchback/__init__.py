"""hf_switchback: SwitchBack int8/fp8 quantized training for Hugging Face CLIP models.

from hf_switchback import SwitchBackConfig, apply_switchback
model = apply_switchback(CLIPModel.from_pretrained(...), SwitchBackConfig(weight_scaling="row"))
"""

# Configuration (KernelOptions: how the GPU kernels run, carried by SwitchBackConfig.kernel_options)
from .config import DEFAULT_EXCLUDE_MODULES, DEFAULT_TARGET_MODULES, KernelOptions, SwitchBackConfig

# Model conversion
from .convert import apply_switchback, remove_switchback, switchback_modules

# Layers and functional form
from .functional import switchback_linear
from .modules import SwitchBackLinear

# What runs 8-bit on a device (token floors, measured crossovers) and why the rest does not
from .precision_summary import precision_summary

# isort: split
# Inference: quantize weights once for eval / serving, reversibly
from .inference import prepare_for_inference, restore_training, switchback_inference

# Guard against combining SwitchBack with another 8-bit scheme (accelerate fp8, torchao, bitsandbytes)
from .interop import check_fp8_interop

# isort: split
# transformers and Hub integration. Importing .quantizer registers quant_method "switchback", so that
# from_pretrained(..., quantization_config=SwitchBackConfig(...)) and reloading saved checkpoints work.
from .hub import model_card, push_to_hub
from .quantizer import SwitchBackHfQuantizer, strip_quantization_config

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_EXCLUDE_MODULES",
    "DEFAULT_TARGET_MODULES",
    "KernelOptions",
    "SwitchBackConfig",
    "SwitchBackHfQuantizer",
    "SwitchBackLinear",
    "__version__",
    "apply_switchback",
    "check_fp8_interop",
    "model_card",
    "precision_summary",
    "prepare_for_inference",
    "push_to_hub",
    "remove_switchback",
    "restore_training",
    "strip_quantization_config",
    "switchback_inference",
    "switchback_linear",
    "switchback_modules",
]
