"""Run under `accelerate launch --num_processes 2`: each rank takes its half of a fixed batch, computes the
ClipLoss (local_loss, gather_with_grad) through DDP, and rank 0 saves the global loss and every gradient."""

import argparse
import weakref

import torch
from accelerate import Accelerator
from train_helpers import fixed_batch, tiny_model

from hf_switchback.training.lifecycle import end_training
from hf_switchback.training.losses import ClipLoss
from hf_switchback.training.step import CLIPForContrastive, contrastive_backward

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--per_rank", type=int, default=4)
parser.add_argument("--accum_freq", type=int, default=1)
args = parser.parse_args()

accelerator = Accelerator(cpu=True)
rank, world = accelerator.process_index, accelerator.num_processes
batch = fixed_batch(args.per_rank * world)
mine = {k: v[rank * args.per_rank : (rank + 1) * args.per_rank] for k, v in batch.items()}
micro = [{k: v.chunk(args.accum_freq)[j] for k, v in mine.items()} for j in range(args.accum_freq)]

results = {}
for switchback in (False, True):
    model = accelerator.prepare(CLIPForContrastive(tiny_model(switchback=switchback)))
    unwrapped = accelerator.unwrap_model(model)
    for local_loss, gather_with_grad in ((True, True), (False, True), (True, False)):
        model.zero_grad(set_to_none=True)
        loss_fn = ClipLoss(local_loss=local_loss, gather_with_grad=gather_with_grad)
        loss = contrastive_backward(model, loss_fn, micro, accelerator)
        # the global loss is the mean of the ranks' losses (local_loss) or any rank's (global logits)
        loss = accelerator.reduce(loss.clone(), reduction="mean")
        grads = {n: p.grad.clone() for n, p in unwrapped.named_parameters() if p.grad is not None}
        key = f"sb{int(switchback)}_local{int(local_loss)}_gwg{int(gather_with_grad)}"
        results[key] = {"loss": loss.item(), "grads": grads}
if accelerator.is_main_process:
    torch.save(results, args.out)
# the library's teardown, as train_clip.py ends: a DDP model that outlives the gloo process group can abort or
# hang the exit ("terminate called without an active exception")
model_ref = weakref.ref(model)
del model, unwrapped
end_training(accelerator, model_ref)
