"""bitsandbytes' SwitchBack layer names, for code written against them (OpenCLIP's `--use-bnb-linear`).

bitsandbytes 0.50 removed `bitsandbytes.nn.triton_based_modules`; OpenCLIP looks its classes up by name there
and builds each as `cls(in_features, out_features, bias)` (open_clip.utils.replace_linear), copies the weights
in, and for evaluation calls `prepare_for_eval()` (convert_int8_model_to_inference_mode). The classes below
take the same constructor arguments and are hf_switchback SwitchBackLinear layers:

    SwitchBackLinear(in, out, bias=True, device=None, dtype=None, vector_wise_quantization=False,
                     mem_efficient=False)
    SwitchBackLinearGlobal              weight_scaling="tensor"
    SwitchBackLinearVectorwise          weight_scaling="row"
    SwitchBackLinearGlobalMemEfficient  weight_scaling="tensor", memory_efficient=True

Differences from bitsandbytes, on purpose:
- min_tokens=0: every call runs 8-bit, as bitsandbytes did. (hf_switchback's own default on CUDA keeps shapes
  whose 8-bit path does not pay in 16-bit.)
- grad_precision="auto": the grad-input GEMM uses fp8 on GPUs with fp8 tensor cores (Ada, Hopper), int8
  elsewhere (as bitsandbytes always did); see SwitchBackConfig.grad_precision for why.
- Runs without Triton (torch reference path on CPU); vector-wise + mem_efficient is allowed.
- prepare_for_eval() keeps `weight` (bitsandbytes deleted it): the 8-bit copy is a cache that no-grad forwards
  use, and a grad-enabled forward drops it, so training can resume.
"""

from __future__ import annotations

from .config import SwitchBackConfig
from .modules import SwitchBackLinear as _SwitchBackLinear
from .weight_cache import quantize_weight_cache


def bnb_config(vector_wise_quantization: bool = False, mem_efficient: bool = False) -> SwitchBackConfig:
    """The SwitchBackConfig matching bitsandbytes' SwitchBackLinear flags (8-bit at every batch size)."""
    return SwitchBackConfig(
        weight_scaling="row" if vector_wise_quantization else "tensor",
        memory_efficient=mem_efficient,
        min_tokens=0,
    )


class SwitchBackLinear(_SwitchBackLinear):
    """bitsandbytes' constructor; `config`, when given (as SwitchBackLinear.from_linear does), wins over the
    two flags."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        vector_wise_quantization: bool = False,
        mem_efficient: bool = False,
        *,
        config: SwitchBackConfig | None = None,
    ) -> None:
        config = config or bnb_config(vector_wise_quantization, mem_efficient)
        super().__init__(in_features, out_features, bias, device, dtype, config=config)
        # bitsandbytes' attribute, read by code that checks which variant a layer is
        self.vector_wise_quantization = config.weight_scaling == "row"

    def prepare_for_eval(self) -> None:
        """Quantize the weight once for no-grad forwards (hf_switchback.prepare_for_inference, one layer)."""
        quantize_weight_cache(self)


class SwitchBackLinearGlobal(SwitchBackLinear):
    """Tensor-wise ("global") weight scale."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, config=None):
        super().__init__(in_features, out_features, bias, device, dtype, False, False, config=config)


class SwitchBackLinearVectorwise(SwitchBackLinear):
    """Row-wise weight scales."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, config=None):
        super().__init__(in_features, out_features, bias, device, dtype, True, False, config=config)


class SwitchBackLinearGlobalMemEfficient(SwitchBackLinear):
    """Tensor-wise weight scale; the input is saved in 8 bits for backward."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, config=None):
        super().__init__(in_features, out_features, bias, device, dtype, False, True, config=config)


__all__ = [
    "SwitchBackLinear",
    "SwitchBackLinearGlobal",
    "SwitchBackLinearGlobalMemEfficient",
    "SwitchBackLinearVectorwise",
    "bnb_config",
]
