"""Run under `accelerate launch --num_processes 4`: SigLipLoss with every dist_impl, each rank saving its own
results to <out>/rank<R>.pt for the test to compare with one process on the concatenated batch.

1. float64 features (equal batches, and an uneven last batch): this rank's loss, the gradients of its
   features, and logit scale / bias gradients summed over ranks, after backward of loss / world on each rank.
2. a tiny SiglipModel (fp32 linears, then SwitchBack int8 on the torch reference kernels) through DDP: the
   global loss and every parameter gradient; bidir also with accum_freq 2 (cached features).
"""

import argparse
import os
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from train_helpers import fixed_batch, tiny_model

from hf_switchback.training import SigLipLoss
from hf_switchback.training.lifecycle import end_training
from hf_switchback.training.siglip_loss import DIST_IMPLS
from hf_switchback.training.step import CLIPForContrastive, contrastive_backward

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

accelerator = Accelerator(cpu=True)
rank, world = accelerator.process_index, accelerator.num_processes
results = {}

# 1. features alone, float64
g = torch.Generator().manual_seed(0)
features = {k: F.normalize(torch.randn(4 * world, 8, generator=g, dtype=torch.float64), dim=-1) for k in "it"}
for sizes in ([4] * world, [4] * (world - 1) + [1]):
    start = sum(sizes[:rank])
    for impl in DIST_IMPLS:
        image, text = (features[k][start : start + sizes[rank]].clone().requires_grad_() for k in "it")
        scale = torch.tensor(10.0, dtype=torch.float64, requires_grad=True)
        bias = torch.tensor(-5.0, dtype=torch.float64, requires_grad=True)
        loss = SigLipLoss(dist_impl=impl)(image, text, scale, bias)
        (loss / world).backward()
        sums = torch.stack([loss.detach() / world, scale.grad, bias.grad])
        dist.all_reduce(sums)
        results[("features", tuple(sizes), impl)] = {
            "loss": sums[0].item(),
            "scale_grad": sums[1].item(),
            "bias_grad": sums[2].item(),
            "image_grad": image.grad,
            "text_grad": text.grad,
        }

# 2. a SiglipModel through DDP
batch = fixed_batch(4 * world)
mine = {k: v[rank * 4 : (rank + 1) * 4] for k, v in batch.items()}
for switchback in (False, True):
    model = accelerator.prepare(CLIPForContrastive(tiny_model(switchback=switchback, siglip=True)))
    unwrapped = accelerator.unwrap_model(model)
    runs = [(impl, 1) for impl in DIST_IMPLS] + [("bidir", 2)]
    for impl, accum_freq in runs:
        model.zero_grad(set_to_none=True)
        micro = [{k: v.chunk(accum_freq)[j] for k, v in mine.items()} for j in range(accum_freq)]
        loss = contrastive_backward(model, SigLipLoss(dist_impl=impl), micro, accelerator)
        loss = accelerator.reduce(loss.clone(), reduction="mean")
        grads = {n: p.grad.clone() for n, p in unwrapped.named_parameters() if p.grad is not None}
        results[("model", switchback, impl, accum_freq)] = {"loss": loss.item(), "grads": grads}

torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
# the library's teardown, as train_clip.py ends: a DDP model that outlives the gloo process group can abort or
# hang the exit ("terminate called without an active exception")
model_ref = weakref.ref(model)
del model, unwrapped
end_training(accelerator, model_ref)
