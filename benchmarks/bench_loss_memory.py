"""Peak memory of one rank's contrastive loss (forward + backward), CLIP's softmax loss vs SigLIP's sigmoid loss.

One GPU stands in for rank 0 of `--world` ranks at global batch `--batch`: each variant computes exactly the
tensors rank 0 would (the other ranks' features are slices of one (batch, dim) tensor, as if received), under
bf16 autocast, and the figure is the peak memory above the features themselves.

  clip-global   ClipLoss(local_loss=False): every rank builds the (global x global) logits
  clip-local    ClipLoss(local_loss=True): (local x global) logits, image->text and text->image
  siglip        SigLipLoss (bidir / shift): (local x local) blocks, one per rank, negatives only but one

    PYTHONPATH=src python benchmarks/bench_loss_memory.py --batch 32768 --world 8 --json $OUT/loss_memory.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from hf_switchback.training.siglip_loss import sigmoid_loss_sum


def rank0_loss(variant: str, image, text, world: int):
    n = image.shape[0]
    local = n // world
    scale, bias = torch.tensor(10.0, device=image.device), torch.tensor(-10.0, device=image.device)
    if variant == "clip-global":
        logits = scale * image @ text.T
        labels = torch.arange(n, device=image.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    if variant == "clip-local":
        labels = torch.arange(local, device=image.device)
        per_image, per_text = scale * image[:local] @ text.T, scale * text[:local] @ image.T
        return (F.cross_entropy(per_image, labels) + F.cross_entropy(per_text, labels)) / 2
    blocks = text.split(local)
    total = sum(
        sigmoid_loss_sum(image[:local], block, scale, bias, positives=j == 0)
        for j, block in enumerate(blocks)
    )
    return total / local


def measure(variant: str, batch: int, dim: int, world: int, device: str) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    image = F.normalize(torch.randn(batch, dim, device=device, generator=g), dim=-1).requires_grad_()
    text = F.normalize(torch.randn(batch, dim, device=device, generator=g), dim=-1).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = rank0_loss(variant, image, text, world)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return dict(variant=variant, batch=batch, world=world, local_batch=batch // world, dim=dim,
                peak_above_features_mib=peak / 2**20, loss=loss.item())  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32768, help="global batch")
    parser.add_argument("--world", type=int, default=8, help="ranks simulated (rank 0 measured)")
    parser.add_argument("--dim", type=int, default=768, help="embedding width (SigLIP B/16: 768)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.batch % args.world:
        parser.error("--batch must be a multiple of --world")
    rows = []
    for variant in ("clip-global", "clip-local", "siglip"):
        try:
            row = measure(variant, args.batch, args.dim, args.world, "cuda")
        except torch.OutOfMemoryError as err:
            row = dict(variant=variant, batch=args.batch, world=args.world, error=str(err).splitlines()[0])
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        assert "error" in row or math.isfinite(row["loss"])
    if args.json:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
