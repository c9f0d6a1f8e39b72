"""ClipLoss: single-process values, and the 2-process (gloo) loss + gradients against the concatenated batch."""

import os

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from train_helpers import fixed_batch, launch, tiny_model

from hf_switchback.training import ClipLoss
from hf_switchback.training.step import CLIPForContrastive, contrastive_backward

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_dist_loss_worker.py")


def test_clip_loss_is_symmetric_cross_entropy():
    image = F.normalize(torch.randn(6, 8), dim=-1)
    text = F.normalize(torch.randn(6, 8), dim=-1)
    scale = torch.tensor(10.0)
    logits = scale * image @ text.T
    expected = (F.cross_entropy(logits, torch.arange(6)) + F.cross_entropy(logits.T, torch.arange(6))) / 2
    assert torch.allclose(ClipLoss()(image, text, scale), expected)
    assert torch.allclose(ClipLoss(local_loss=True, gather_with_grad=True)(image, text, scale), expected)
    # perfectly aligned pairs with a large scale give a loss near zero
    assert ClipLoss()(image, image, torch.tensor(100.0)) < 0.05
    assert ClipLoss()(image, text, scale, output_dict=True)["contrastive_loss"] == expected


def reference(per_rank: int, world: int, switchback: bool = False):
    """Loss and gradients of one process on the concatenated batch of all ranks."""
    model = CLIPForContrastive(tiny_model(switchback=switchback))
    batch = fixed_batch(per_rank * world)
    loss = contrastive_backward(model, ClipLoss(), [batch], Accelerator(cpu=True))
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def grads_off(grads, ref_grads, switchback: bool) -> list[str]:
    """Names of the gradients outside the bound. fp32: only the order of summation differs, 1e-5 absolute.
    SwitchBack int8 quantizes per token (and weights per tensor), so a rank's rows quantize as in the whole
    batch, but the float-order noise of the loss gradient can move an output-gradient entry across an int8
    rounding boundary (1/127 of its row's absmax): each gradient within 1e-3 of its tensor's largest entry, as
    in test_siglip_loss.py (an absolute 1e-5 would fail on such a flip). k_proj's bias has an exact gradient of
    zero (softmax ignores a shift shared by all keys): both sides hold float32 rounding noise of its column sum
    (~1e-7 here, as large as the entries themselves), so it gets the noise floor, 1e-6, as its bound."""
    assert grads.keys() == ref_grads.keys()
    bound = {n: 1e-3 * ref.abs().max().item() + 1e-7 if switchback else 1e-5 for n, ref in ref_grads.items()}
    if switchback:
        bound.update({n: 1e-6 for n in ref_grads if n.endswith("k_proj.bias")})
    return [n for n, ref in ref_grads.items() if (grads[n] - ref).abs().max().item() > bound[n]]


@pytest.mark.slow
@pytest.mark.parametrize("accum_freq", [1, 2])
def test_two_process_loss_and_grads_equal_single_process(tmp_path, accum_freq):
    out = tmp_path / "dist.pt"
    launch([WORKER, "--out", str(out), "--per_rank", "4", "--accum_freq", str(accum_freq)], num_processes=2)
    results = torch.load(out)
    for sb in (0, 1):  # plain fp32 linears, and SwitchBack int8 (torch reference kernels)
        ref_loss, ref_grads = reference(per_rank=4, world=2, switchback=bool(sb))
        for exact in (f"sb{sb}_local1_gwg1", f"sb{sb}_local0_gwg1"):
            assert abs(results[exact]["loss"] - ref_loss) <= 1e-5, exact
            assert grads_off(results[exact]["grads"], ref_grads, switchback=bool(sb)) == [], exact
        # Without the differentiable gather each rank's gradient ignores the other rank's samples: the loss is
        # the same but the gradients are not. (Shows the comparison above can fail.)
        inexact = results[f"sb{sb}_local1_gwg0"]
        assert abs(inexact["loss"] - ref_loss) <= 1e-5
        assert grads_off(inexact["grads"], ref_grads, switchback=bool(sb))
