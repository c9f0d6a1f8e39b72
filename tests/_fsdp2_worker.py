"""Run under `python -m torch.distributed.run --nproc_per_node 2`: FSDP2 (fully_shard, gloo, CPU) on a tiny
CLIPModel with SwitchBack, applied before or after sharding. Every rank feeds the SAME full batch, so the
averaged FSDP gradients must equal the single-process gradients; rank 0 saves both for the test to compare."""

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import tiny_clip_config
from transformers import CLIPModel

from hf_switchback import SwitchBackConfig, SwitchBackLinear, apply_switchback, remove_switchback
from hf_switchback.blocks import is_fused_attention

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--order", choices=["before", "after"], required=True)
parser.add_argument("--fuse_qkv", action="store_true", help="q/k/v of each attention block as one op")
parser.add_argument("--wgrad_precision", default="16bit", help="SwitchBackConfig.wgrad_precision")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
# fully_shard gives an encoder layer a class with a forward of its own, which apply_switchback after it does not
# replace: its LayerNorms stay stock (fuse_norm has no effect there), so the reference runs them stock too.
# (Adam's first step turns the noise-level gradients of q/k projections into lr-sized parameter differences.)
config = SwitchBackConfig(
    backend="torch",
    fuse_qkv=args.fuse_qkv,
    wgrad_precision=args.wgrad_precision,
    fuse_norm=args.order == "before",
)

torch.manual_seed(0)
batch = {
    "input_ids": torch.randint(2, 64, (4, 8)),
    "pixel_values": torch.randn(4, 3, 16, 16),
}


def shard(model):
    for tower in (model.text_model, model.vision_model):
        for layer in tower.encoder.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def train_step(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(**batch, return_loss=True).loss
    loss.backward()
    grads = {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    return loss.item(), grads, params


torch.manual_seed(0)
base = CLIPModel(tiny_clip_config()).train()
# fully_shard rejects 0-d parameters ("Change logit_scale to a 1D tensor with numel equal to 1"); CLIP only
# broadcasts logit_scale.exp(), so a (1,) shape is equivalent. An FSDP2 limitation, unrelated to SwitchBack.
base.logit_scale = torch.nn.Parameter(base.logit_scale.detach().reshape(1))
ref = apply_switchback(copy.deepcopy(base), config)
ref_loss, ref_grads, ref_params = train_step(ref)

model = copy.deepcopy(base)
if args.order == "before":
    apply_switchback(model, config)
    shard(model)
else:
    shard(model)
    apply_switchback(model, config)
sb = [m for m in model.modules() if isinstance(m, SwitchBackLinear)]
checks = {
    "n_switchback": len(sb),
    "n_ref_switchback": sum(isinstance(m, SwitchBackLinear) for m in ref.modules()),
    "n_fused_qkv": sum(is_fused_attention(m) for m in model.modules()),
    "all_dtensor": all(isinstance(m.weight, DTensor) and isinstance(m.bias, DTensor) for m in sb),
}
loss, grads, params = train_step(model)
checks["grads_in_param_dtype"] = all(
    isinstance(p.grad, DTensor) and p.grad.dtype == p.dtype for p in model.parameters() if p.grad is not None
)
# a second forward/backward after the step: FSDP must keep re-gathering into the swapped modules
model.zero_grad()
model(**batch, return_loss=True).loss.backward()
remove_switchback(model)
checks["removed"] = not any(isinstance(m, SwitchBackLinear) for m in model.modules())
checks["removed_dtensor"] = all(isinstance(p, DTensor) for p in model.parameters())
with torch.no_grad():
    checks["loss_after_remove"] = model(**batch, return_loss=True).loss.item()
    checks["ref_loss_after_remove"] = remove_switchback(ref)(**batch, return_loss=True).loss.item()
if rank == 0:
    torch.save(
        {"ref": (ref_loss, ref_grads, ref_params), "fsdp": (loss, grads, params), "checks": checks}, args.out
    )
dist.barrier()
dist.destroy_process_group()
