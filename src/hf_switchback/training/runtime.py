"""What a train_clip.py run asks of Accelerate besides the defaults: the torch.compile plugin (and the GEMM it
selects under CUDA graphs), and the checks a DeepSpeed launch needs before anything is loaded."""

from __future__ import annotations

import logging

import torch
from accelerate.utils import TorchDynamoPlugin

logger = logging.getLogger(__name__)

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


def dynamo_plugin(args) -> TorchDynamoPlugin | None:
    """accelerate's torch.compile settings; with CUDA graphs on Hopper, the TMA 8-bit GEMM too."""
    if not args.torch_compile:
        return None
    mode = args.compile_mode or "default"
    if mode == "reduce-overhead" and args.switchback == "on" and tma_gemm_available():
        # Alone the TMA GEMM is 10-15% faster than the portable one, but its host-side setup made launch-bound
        # steps slower; replayed as a CUDA graph that setup is gone (ViT-B/16: 102.6 vs 106.9 ms/step).
        from ..kernels import matmul

        matmul.USE_TMA = True
        logger.info("CUDA graphs: using the Hopper TMA 8-bit GEMM (hf_switchback.kernels.matmul.USE_TMA)")
    return TorchDynamoPlugin(backend="inductor", mode=mode)


def tma_gemm_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def check_deepspeed(accelerator, args) -> None:
    """DeepSpeed owns accumulation and clipping; our loader is not prepared, so give it the micro-batch size."""
    if args.accum_freq > 1:
        raise ValueError(
            "--accum_freq > 1 needs no_sync between the cached-feature passes, which DeepSpeed does not offer: "
            "use DDP or FSDP2 (accelerate_configs/multi_gpu.yaml, fsdp2.yaml), or --accum_freq 1"
        )
    if args.spike_monitor:
        raise ValueError(
            "--spike_monitor reads the optimizer's second-moment state, which lives inside DeepSpeed's engine "
            "(partitioned, flattened): use DDP or FSDP2 (accelerate_configs/multi_gpu.yaml, fsdp2.yaml)"
        )
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    ds_config["train_micro_batch_size_per_gpu"] = args.batch_size
