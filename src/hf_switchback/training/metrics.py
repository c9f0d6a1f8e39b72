"""Scalars a training run reports, reduced over ranks: loss means, counts, peak CUDA memory, logit scale."""

from __future__ import annotations

import torch


def mean_over_ranks(accelerator, value: float) -> float:
    return accelerator.reduce(torch.tensor(float(value), device=accelerator.device), reduction="mean").item()


def sum_over_ranks(accelerator, value: int) -> int:
    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), reduction="sum").item())


def peak_memory(accelerator) -> dict:
    """Peak CUDA memory of this launch, GiB: the largest rank's, and every rank's; empty without CUDA."""
    if accelerator.device.type != "cuda":
        return {}
    stats = torch.tensor(
        [
            torch.cuda.max_memory_allocated(accelerator.device),
            torch.cuda.max_memory_reserved(accelerator.device),
        ],
        dtype=torch.float64,
        device=accelerator.device,
    )
    per_rank = accelerator.gather(stats[None]).cpu() / 2**30  # (num_processes, 2)
    return {
        "peak_memory_allocated_gib": round(per_rank[:, 0].max().item(), 3),
        "peak_memory_reserved_gib": round(per_rank[:, 1].max().item(), 3),
        "peak_memory_allocated_gib_per_rank": [round(v, 3) for v in per_rank[:, 0].tolist()],
    }


def logit_scale_value(clip) -> float:
    """exp(logit_scale) of a CLIPModel, also when FSDP2 holds it as a sharded DTensor."""
    scale = clip.logit_scale.detach()
    if hasattr(scale, "full_tensor"):  # FSDP2 keeps it as a (sharded) DTensor between forwards
        scale = scale.full_tensor()
    return scale.exp().item()
