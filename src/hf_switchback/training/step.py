"""One optimizer step's forward/backward for contrastive training, with OpenCLIP-style gradient accumulation.

Why not `accelerator.accumulate`: it runs each micro-batch's loss on its own, so each image only sees the
captions of its micro-batch as negatives, and the effective contrastive batch shrinks by `accum_freq`.
OpenCLIP instead (1) embeds all N micro-batches without grad and caches the features, then (2) for each
micro-batch j recomputes its features with grad and takes the loss of the *full* batch, cached features
standing in for the other micro-batches. The gradients of the N backward passes add up to the gradient of
the full-batch loss (each pass supplies the part through micro-batch j's features), at the memory of one
micro-batch. DDP must not all-reduce until the last pass: the first N-1 run under `accelerator.no_sync`.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

MODEL_INPUTS = ("input_ids", "attention_mask", "pixel_values")
MAX_LOGIT_SCALE = math.log(100)


class CLIPForContrastive(nn.Module):
    """A CLIPModel whose forward returns (image_features, text_features, logit_scale.exp()), as OpenCLIP's.

    A SiglipModel (it has a `logit_bias`) returns (image_features, text_features, logit_scale.exp(),
    logit_bias), the arguments of SigLipLoss.

    This wrapper is what `accelerator.prepare` sees, so the temperature is read inside forward: FSDP gathers
    the root parameters only around forward, and DDP expects every trained parameter to be used there.
    """

    def __init__(self, clip: nn.Module):
        super().__init__()
        self.clip = clip

    def forward(self, input_ids, pixel_values, attention_mask=None):
        out = self.clip(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask)
        logit_params = (self.clip.logit_scale.exp(),)
        if hasattr(self.clip, "logit_bias"):
            logit_params += (self.clip.logit_bias,)
        return out.image_embeds, out.text_embeds, *logit_params


def clip_features(model, batch: dict):
    """(image (B, D), text (B, D), logit_scale () or (1,)[, logit_bias (1,)]) from a CLIPForContrastive, features
    L2-normalized."""
    return model(**{k: batch[k] for k in MODEL_INPUTS if k in batch})


def contrastive_backward(model, loss_fn, micro_batches: list[dict], accelerator) -> torch.Tensor:
    """Forward + backward of one step over `micro_batches` (accum_freq = len). Returns the detached loss."""
    if len(micro_batches) == 1:
        image, text, *logit_params = clip_features(model, micro_batches[0])
        loss = loss_fn(image, text, *logit_params)
        accelerator.backward(loss)
        return loss.detach()

    with torch.no_grad():
        cached = [clip_features(model, mb) for mb in micro_batches]
    cached_images = [c[0] for c in cached]
    cached_texts = [c[1] for c in cached]
    for j, mb in enumerate(micro_batches):
        last = j == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last else accelerator.no_sync(model)
        with sync:
            image, text, *logit_params = clip_features(model, mb)
            images = torch.cat([*cached_images[:j], image, *cached_images[j + 1 :]])
            texts = torch.cat([*cached_texts[:j], text, *cached_texts[j + 1 :]])
            # Every pass computes the full-batch loss, so the temperature's (and SigLIP's bias') gradient would
            # be counted N times; only the last pass lets it through (OpenCLIP counts it N times).
            loss = loss_fn(images, texts, *(p if last else p.detach() for p in logit_params))
            accelerator.backward(loss)
    # All N losses are the same full-batch loss (up to recompute noise); report the last.
    return loss.detach()


def logit_scale_to_1d(clip: nn.Module) -> None:
    """Give CLIP's 0-d `logit_scale` the shape (1,), same value, in place; a no-op when it is already 1-D.

    FSDP2's `fully_shard` refuses 0-d Parameters ("change to a 1-D tensor"), and ZeRO-3 partitions along the
    first dimension too. Call it before the optimizer is built (the optimizer must see the new Parameter).
    Numerics are unchanged: every use is `logit_scale.exp() * logits`, which broadcasts. Undo it on the saved
    weights with `export_state_dict`, so the checkpoint loads into a plain CLIPModel.
    """
    scale = clip.logit_scale
    if scale.ndim == 0:
        clip.logit_scale = nn.Parameter(scale.detach().reshape(1), requires_grad=scale.requires_grad)


def export_state_dict(state_dict: dict, scalar_logit_scale: bool = True) -> dict:
    """A (gathered) state dict as the model class stores it: CLIPModel's `logit_scale` back to 0-d.
    scalar_logit_scale=False for SiglipModel, whose `logit_scale` (and `logit_bias`) are (1,) already."""
    if not scalar_logit_scale:
        return state_dict
    return {
        k: v.reshape(()) if k.endswith("logit_scale") and v.numel() == 1 else v for k, v in state_dict.items()
    }


def clamp_logit_scale(clip: nn.Module) -> None:
    """OpenCLIP: keep the (log) temperature in [0, ln 100] after every optimizer step."""
    with torch.no_grad():
        clip.logit_scale.clamp_(0, MAX_LOGIT_SCALE)
