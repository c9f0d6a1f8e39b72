"""Patch dropout for the Hugging Face CLIP vision tower (Li et al., FLIP; OpenCLIP's `--force-patch-dropout`).

During training, keep the class token (CLIP; SigLIP has none) and a random subset of (1 - p) of the patch tokens of each image, after
position embeddings are added, so the encoder runs on fewer tokens (faster, and a regularizer). Eval is untouched.
HF's CLIPVisionModel has no such option, so this is a forward hook on `vision_model.embeddings` that replaces
its output; it draws from the global torch RNG (on the embeddings' device), which save_state/load_state restore.
"""

from __future__ import annotations

import torch
from torch import nn


class PatchDropout:
    def __init__(self, prob: float, prefix_tokens: int = 1):
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"patch dropout probability must be in [0, 1), got {prob}")
        self.prob, self.prefix_tokens = prob, prefix_tokens  # tokens always kept: CLIP's class token

    def __call__(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        if not module.training or self.prob == 0.0:
            return output
        batch, tokens, dim = output.shape
        prefix = self.prefix_tokens
        patches = tokens - prefix
        keep = max(1, int(patches * (1 - self.prob)))
        # argsort of uniform noise = an independent random subset per sample
        order = torch.rand(batch, patches, device=output.device).argsort(dim=1)[:, :keep] + prefix
        index = torch.cat([torch.arange(prefix, device=order.device).expand(batch, prefix), order], dim=1)
        return output.gather(1, index[..., None].expand(-1, -1, dim))


def add_patch_dropout(model: nn.Module, prob: float):
    """Hook patch dropout into a CLIPModel / CLIPVisionModel / SiglipModel; returns the hook handle (call
    .remove() to undo)."""
    vision = model.vision_model if hasattr(model, "vision_model") else model
    prefix = 1 if hasattr(vision.embeddings, "class_embedding") else 0  # SigLIP: every token is a patch
    return vision.embeddings.register_forward_hook(PatchDropout(prob, prefix_tokens=prefix))
