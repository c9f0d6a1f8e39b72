"""What a train_clip.py run asks of Accelerate besides the defaults: the torch.compile plugin (and the kernel
options it calls for under CUDA graphs, the file that carries its caches to the next run), the collective
timeout, and the checks a DeepSpeed launch needs before anything is loaded."""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
from accelerate.utils import InitProcessGroupKwargs, TorchDynamoPlugin

from ..adapters.accelerate import init_process_group_kwargs
from ..compile_cache import allow_compile_cache, artifacts_file, save_compile_artifacts
from ..kernels.options import KernelOptions

logger = logging.getLogger(__name__)

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
# model: one graph for the whole model; blocks: accelerate's regional compilation (each repeated layer class
# compiled once, its code reused by every layer of that class)
COMPILE_SCOPES = ("model", "blocks")


def dynamo_plugin(args) -> TorchDynamoPlugin | None:
    """accelerate's torch.compile settings (None without --torch_compile)."""
    if not args.torch_compile:
        return None
    # A resumed or repeated run then loads our Triton kernels from torch.compile's disk cache with torch's static
    # launcher, and custom autograd Functions outside SwitchBack's graph leaves are cached too (compile_cache.py).
    allow_compile_cache()
    regional = compile_scope(args) == "blocks"
    return TorchDynamoPlugin(
        backend="inductor", mode=args.compile_mode or "default", use_regional_compilation=regional
    )


def compile_scope(args) -> str:
    """--compile_scope, or its default: per block (a much shorter first step at a step time as fast, BENCHMARKS.md
    'Whole training step'), except under CUDA graphs, which replay one graph per compiled region and so need
    the whole model when layers are recomputed."""
    if getattr(args, "compile_scope", None):
        return args.compile_scope
    return "model" if args.compile_mode == "reduce-overhead" else "blocks"


def compile_artifacts_path(args) -> str | None:
    """The file that carries torch.compile's caches from one run to the next (--compile_cache_dir, by default
    <output_dir>/compile_cache; None without --torch_compile or with `none`). Every rank loads it before compiling
    (compile_cache.load_compile_artifacts); the main process writes it (write_compile_artifacts)."""
    if not args.torch_compile:
        return None
    directory = getattr(args, "compile_cache_dir", None) or os.path.join(args.output_dir, "compile_cache")
    return None if directory.lower() == "none" else artifacts_file(directory)


def write_compile_artifacts(accelerator, path: str | None) -> None:
    """Main process, once, after the first training step (everything the step compiles has compiled by then):
    write the compile artifacts to `path`. Graphs that compile later (evaluation) are not in it: a second save of
    one process reads back as only what it added (torch.compiler's format, torch 2.13)."""
    if path is not None and accelerator.is_main_process:
        save_compile_artifacts(path)


def kernel_options(args) -> KernelOptions:
    """The run's SwitchBack KernelOptions: the defaults, with CUDA graphs on Hopper the TMA 8-bit GEMM, and
    --cache_weight_operands."""
    options = KernelOptions(cache_weight_operands=args.cache_weight_operands)
    graphs = args.torch_compile and args.compile_mode == "reduce-overhead"
    if graphs and tma_gemm_available():
        # Alone the TMA GEMM is faster than the portable one, but its host-side setup makes launch-bound steps
        # slower; replayed as a CUDA graph that setup is gone (BENCHMARKS.md, Whole training step).
        logger.info("CUDA graphs: using the Hopper TMA 8-bit GEMM (KernelOptions(use_tma=True))")
        return options.replace(use_tma=True)
    return options


def process_group_kwargs(timeout_minutes: float) -> InitProcessGroupKwargs:
    """--ddp_timeout for `Accelerator(kwargs_handlers=[...])`: how long a collective waits for a stuck rank.

    Without it the timeout is whatever torch picks per backend (30 min for gloo, 10 for NCCL), and nothing says
    so. 30 min by default, as HF Trainer's `ddp_timeout`: the longest stretch one rank legitimately runs alone
    (the main process writing the final model and a checkpoint, evaluating, pushing to the Hub) must fit, or a
    healthy run dies; a stuck rank costs at most that long.
    """
    return init_process_group_kwargs(timedelta(minutes=timeout_minutes))


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
