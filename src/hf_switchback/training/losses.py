"""CLIP's contrastive loss, in OpenCLIP's calling convention so users moving over recognize it.

    loss_fn = ClipLoss(local_loss=True, gather_with_grad=True)
    loss = loss_fn(image_features, text_features, logit_scale)   # normalized features, exp()'d scale

Distributed: features are all-gathered so every rank scores its samples against the global batch.
- gather_with_grad: `torch.distributed.nn.functional.all_gather` is differentiable (its backward sums the
  gradients of all ranks into each rank's slice), so the loss is exact without recomputing on every rank.
  `accelerate.gather` / `dist.all_gather` are not differentiable: with them only the local slice carries
  gradient, which is the classic OpenCLIP setup of `gather_with_grad=False`.
- local_loss: each rank computes only its own rows of the (global x global) logits, against every column;
  labels are offset by rank * local_batch. Cost per rank drops from B^2 to B*B/world; with gradient averaging
  across ranks (DDP) the result equals the single-process loss on the concatenated batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_features(image_features, text_features, *, local_loss: bool, gather_with_grad: bool):
    """(B, D) per rank -> (world*B, D) each, ranks in order. Every rank must pass the same B."""
    rank, world = _dist_info()
    if world == 1:
        return image_features, text_features
    if gather_with_grad:
        import torch.distributed.nn.functional as dist_nn

        return torch.cat(dist_nn.all_gather(image_features)), torch.cat(dist_nn.all_gather(text_features))
    gathered_image = [torch.empty_like(image_features) for _ in range(world)]
    gathered_text = [torch.empty_like(text_features) for _ in range(world)]
    dist.all_gather(gathered_image, image_features)
    dist.all_gather(gathered_text, text_features)
    if not local_loss:
        # Put the local tensors (which carry the graph) back in place, so this rank's features get gradient.
        gathered_image[rank], gathered_text[rank] = image_features, text_features
    return torch.cat(gathered_image), torch.cat(gathered_text)


class ClipLoss(nn.Module):
    """Symmetric InfoNCE over image<->text logits.

    forward(image_features (B, D), text_features (B, D), logit_scale () already exp()'d, output_dict=False)
    -> scalar loss (or {"contrastive_loss": loss}); features are expected L2-normalized.
    """

    def __init__(self, local_loss: bool = False, gather_with_grad: bool = False):
        super().__init__()
        self.local_loss, self.gather_with_grad = local_loss, gather_with_grad
        self._labels: dict[tuple, torch.Tensor] = {}

    def labels(self, num_logits: int, device: torch.device) -> torch.Tensor:
        rank, world = _dist_info()
        key = (num_logits, str(device), rank, world, self.local_loss)
        if key not in self._labels:
            labels = torch.arange(num_logits, device=device)
            if world > 1 and self.local_loss:
                labels = labels + num_logits * rank
            self._labels[key] = labels
        return self._labels[key]

    def logits(self, image_features, text_features, logit_scale):
        """(logits_per_image, logits_per_text): local rows x global columns, or global x global."""
        _, world = _dist_info()
        if world == 1:
            logits_per_image = logit_scale * image_features @ text_features.T
            return logits_per_image, logits_per_image.T
        all_image, all_text = gather_features(
            image_features, text_features, local_loss=self.local_loss, gather_with_grad=self.gather_with_grad
        )
        if self.local_loss:
            return logit_scale * image_features @ all_text.T, logit_scale * text_features @ all_image.T
        logits_per_image = logit_scale * all_image @ all_text.T
        return logits_per_image, logits_per_image.T

    def forward(self, image_features, text_features, logit_scale, output_dict: bool = False):
        logits_per_image, logits_per_text = self.logits(image_features, text_features, logit_scale)
        labels = self.labels(logits_per_image.shape[0], image_features.device)
        loss = (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2
        return {"contrastive_loss": loss} if output_dict else loss
