"""hf_switchback: SwitchBack int8/fp8 quantized training for Hugging Face CLIP models.

from hf_switchback import SwitchBackConfig, apply_switchback
model = apply_switchback(CLIPModel.from_pretrained(...), SwitchBackConfig(weight_scaling="row"))
"""

# Configuration
from .config import DEFAULT_EXCLUDE_MODULES, DEFAULT_TARGET_MODULES, SwitchBackConfig

# Model conversion
from .convert import apply_switchback, remove_switchback, switchback_modules

# Layers and functional form
from .functional import switchback_linear
from .modules import SwitchBackLinear

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_EXCLUDE_MODULES",
    "DEFAULT_TARGET_MODULES",
    "SwitchBackConfig",
    "SwitchBackLinear",
    "__version__",
    "apply_switchback",
    "remove_switchback",
    "switchback_linear",
    "switchback_modules",
]
