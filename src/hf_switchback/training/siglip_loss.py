"""SigLIP's sigmoid loss (Zhai et al., arXiv 2303.15343) in OpenCLIP's calling convention.

    loss_fn = SigLipLoss(dist_impl="bidir")
    loss = loss_fn(image_features, text_features, logit_scale, logit_bias)  # normalized features, exp()'d scale

Each image-text pair is its own binary classification, +1 for the matching pair and -1 for every other:
loss = -sum log sigmoid(label * (scale * <image, text> + bias)) / local batch. There is no softmax across the
batch, so a rank never needs the global logits: it scores its images against its own texts (the only block
holding positives), then against each other rank's texts (negatives only), one block at a time, the blocks
travelling between ranks:
- "bidir": texts go to both ring neighbours at once, ceil((W-1)/2) rounds (OpenCLIP's default);
- "shift": texts go one way round the ring, W-1 rounds;
- "reduce": W all-reduces, rank i contributing its texts and the others zeros (a simple baseline);
- "gather": one all-gather of every rank's texts (W blocks in memory at once, like CLIP's gather).
Every exchange is differentiable: its backward sends the gradient of a received block back to the rank that
owns those texts. So the mean of the ranks' losses is the single-process loss on the concatenated batch, and
with DDP's gradient averaging every gradient is the single-process one.

Memory: the logits a rank keeps for backward are still (local batch x global batch) in total, as with
ClipLoss(local_loss=True); what the block-wise form saves is the all-gather of all features at once (bidir and
shift hold one or two foreign blocks at a time) and the (global x global) logits of a non-local CLIP loss.

Batches of different sizes across ranks (an uneven last batch) are handled: every call all-gathers the ranks'
batch sizes (one int each; it costs a host sync), pads the exchanged texts to the largest and drops the
padding on arrival, and divides by the mean local batch (global batch / W) instead of the local one, which is
what keeps the mean over ranks equal to the single-process loss. With equal sizes that is OpenCLIP's divisor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .losses import _dist_info

DIST_IMPLS = ("bidir", "shift", "reduce", "gather")


def _p2p(tensors, to_ranks, from_ranks) -> list[torch.Tensor]:
    """Send tensors[i] to to_ranks[i] and receive a tensor of its shape from from_ranks[i], all at once."""
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in zip(tensors, to_ranks, strict=True)]
    ops += [dist.P2POp(dist.irecv, buf, peer) for buf, peer in zip(received, from_ranks, strict=True)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class _Exchange(torch.autograd.Function):
    """tensors[i] goes to to_ranks[i]; output i arrives from from_ranks[i] (same shape).

    Backward is the same exchange reversed: the gradient of output i goes back to from_ranks[i], the gradient
    of tensors[i] arrives from to_ranks[i] (the rank that used it).
    """

    @staticmethod
    def forward(ctx, to_ranks: tuple[int, ...], from_ranks: tuple[int, ...], *tensors: torch.Tensor):
        ctx.to_ranks, ctx.from_ranks = to_ranks, from_ranks
        return tuple(_p2p(tensors, to_ranks, from_ranks))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        back = _p2p(grads, ctx.from_ranks, ctx.to_ranks)
        return (None, None, *back)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the gradient of a sum is the sum of the gradients, so backward is the same op."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor):
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllReduceSum.apply(grad)


class _AllGather(torch.autograd.Function):
    """(B, D) per rank -> (W*B, D), ranks in order; backward sums every rank's gradient of this rank's slice."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor):
        tensor = tensor.contiguous()
        out = tensor.new_empty((dist.get_world_size() * tensor.shape[0], *tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad)
        return out


def sigmoid_loss_sum(
    image_features, text_features, logit_scale, logit_bias, *, positives: bool
) -> torch.Tensor:
    """sum of -log sigmoid(label * logits) over the (B_i, B_t) block; label +1 on the diagonal if `positives`."""
    logits = logit_scale * image_features @ text_features.T + logit_bias
    if logits.dtype in (torch.float16, torch.bfloat16):
        # the sum runs over B_i x B_t terms: in fp32, as cross-entropy autocasts (the matmul stays 16-bit)
        logits = logits.float()
    signs = -torch.ones_like(logits)
    if positives:
        signs.diagonal().fill_(1.0)
    return -F.logsigmoid(signs * logits).sum()


class SigLipLoss(nn.Module):
    """Sigmoid image-text loss of this rank's images against the texts of all ranks.

    forward(image_features (B, D), text_features (B, D), logit_scale () or (1,) already exp()'d, logit_bias
    () or (1,), output_dict=False) -> scalar (or {"contrastive_loss": loss}); features L2-normalized, any float
    dtype. rank / world_size default to torch.distributed's at call time.
    """

    def __init__(self, rank: int | None = None, world_size: int | None = None, dist_impl: str = "bidir"):
        super().__init__()
        if dist_impl not in DIST_IMPLS:
            raise ValueError(f"SigLipLoss: dist_impl must be one of {DIST_IMPLS}, got {dist_impl!r}")
        if world_size is not None and (world_size < 1 or not 0 <= (rank or 0) < world_size):
            raise ValueError(
                f"SigLipLoss: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        self.rank, self.world_size, self.dist_impl = rank, world_size, dist_impl

    def _ranks(self) -> tuple[int, int]:
        rank, world = _dist_info()
        if self.world_size is None:
            return rank, world
        if self.world_size > 1 and (world, rank) != (self.world_size, self.rank or 0):
            raise RuntimeError(
                f"SigLipLoss(rank={self.rank}, world_size={self.world_size}) but torch.distributed has rank "
                f"{rank} of {world}{'' if world > 1 else ' (not initialized)'}: initialize the process group "
                "first, or leave rank/world_size out to take them from it"
            )
        return self.rank or 0, self.world_size

    def forward(self, image_features, text_features, logit_scale, logit_bias, output_dict: bool = False):
        if image_features.shape[0] != text_features.shape[0]:
            raise ValueError(
                f"SigLipLoss: {image_features.shape[0]} images but {text_features.shape[0]} texts; pair i is "
                "(image i, text i), so the counts must match"
            )
        rank, world = self._ranks()
        if world == 1:
            loss = sigmoid_loss_sum(image_features, text_features, logit_scale, logit_bias, positives=True)
            loss = loss / image_features.shape[0]
            return {"contrastive_loss": loss} if output_dict else loss
        sizes = torch.tensor([text_features.shape[0]], device=text_features.device)
        all_sizes = torch.empty(world, dtype=sizes.dtype, device=sizes.device)
        dist.all_gather_into_tensor(all_sizes, sizes)
        sizes = all_sizes.tolist()
        # Pad to the largest batch so every exchanged block has one shape; padding rows are cut on arrival.
        texts = F.pad(text_features, (0, 0, 0, max(sizes) - text_features.shape[0]))
        loss = sum(
            sigmoid_loss_sum(
                image_features, block[: sizes[src]], logit_scale, logit_bias, positives=src == rank
            )
            for src, block in self._text_blocks(texts, rank, world)
        )
        loss = loss * (world / sum(sizes))
        return {"contrastive_loss": loss} if output_dict else loss

    def _text_blocks(self, texts, rank: int, world: int):
        """Yield (owner rank, padded text block) for every rank, this one first, each exactly once."""
        if self.dist_impl == "gather":
            blocks = _AllGather.apply(texts).chunk(world)
        elif self.dist_impl == "reduce":
            # texts * 0 rather than zeros: the product keeps this rank's texts in every all-reduce's graph, so
            # every rank runs every backward all-reduce, in the same order.
            blocks = [_AllReduceSum.apply(texts * float(i == rank)) for i in range(world)]
        if self.dist_impl in ("gather", "reduce"):
            # This rank's own block is taken from the collective's output too (same values): every rank must
            # use every output, or the collectives of backward would not match up across ranks.
            yield rank, blocks[rank]
            yield from ((i, block) for i, block in enumerate(blocks) if i != rank)
            return
        yield rank, texts
        left, right = (rank - 1) % world, (rank + 1) % world
        to_right = to_left = texts
        rounds, odd = ((world - 1) // 2, (world - 1) % 2) if self.dist_impl == "bidir" else (0, world - 1)
        for step in range(1, rounds + 1):
            # Pass on what came from the left to the right and vice versa: round k brings the texts of
            # rank - k (from the left) and rank + k (from the right).
            from_left, from_right = _Exchange.apply((right, left), (left, right), to_right, to_left)
            yield (rank - step) % world, from_left
            yield (rank + step) % world, from_right
            to_right, to_left = from_left, from_right
        for step in range(rounds + 1, rounds + 1 + odd):
            (from_left,) = _Exchange.apply((right,), (left,), to_right)
            yield (rank - step) % world, from_left
            to_right = from_left
