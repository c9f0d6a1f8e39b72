"""SigLipLoss: the single-process value against transformers' own SiglipModel loss, bad inputs, and 4 gloo
processes (every dist_impl) against one process on the concatenated batch."""

import os

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from train_helpers import fixed_batch, launch, tiny_model

from hf_switchback.training import SigLipLoss
from hf_switchback.training.siglip_loss import DIST_IMPLS
from hf_switchback.training.step import CLIPForContrastive, contrastive_backward

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_dist_siglip_worker.py")
WORLD = 4


def sigmoid_loss(image, text, scale, bias):
    """The paper's formula, written out: labels +1 on the diagonal, -1 elsewhere, summed, / batch."""
    labels = 2 * torch.eye(len(image), dtype=image.dtype) - 1
    return -F.logsigmoid(labels * (scale * image @ text.T + bias)).sum() / len(image)


def test_siglip_loss_matches_transformers_siglip_model():
    model = tiny_model(siglip=True)
    with torch.no_grad():
        model.logit_scale.fill_(2.3)
        model.logit_bias.fill_(-4.0)
    batch = fixed_batch(6)
    out = model(**batch, return_loss=True)
    loss = SigLipLoss()(out.image_embeds, out.text_embeds, model.logit_scale.exp(), model.logit_bias)
    assert torch.allclose(loss, out.loss, rtol=1e-6, atol=1e-6)
    image, text, scale, bias = CLIPForContrastive(model)(**batch)
    assert torch.allclose(
        SigLipLoss()(image, text, scale, bias, output_dict=True)["contrastive_loss"], out.loss
    )
    # orthonormal, aligned pairs with a large scale and a negative bias: near zero; the bias alone moves it
    basis = torch.eye(6, 8)
    assert SigLipLoss()(basis, basis, torch.tensor(100.0), torch.tensor(-50.0)) < 1e-3
    assert SigLipLoss()(image, text, scale, bias) != SigLipLoss()(image, text, scale, bias + 1)


def test_siglip_loss_sums_in_float32_under_bf16_autocast():
    features = F.normalize(torch.randn(256, 32, generator=torch.Generator().manual_seed(0)), dim=-1)
    scale, bias = torch.tensor(10.0), torch.tensor(-10.0)
    reference = sigmoid_loss(features.double(), features.double(), scale.double(), bias.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = SigLipLoss()(features, features, scale, bias)
    # 65536 terms: a bf16 sum would be off by ~0.4% (8 bits of mantissa); the matmul's own rounding is less
    assert loss.dtype == torch.float32 and abs(loss.item() / reference.item() - 1) < 1e-3


def test_siglip_loss_refuses_bad_arguments():
    with pytest.raises(ValueError, match="dist_impl must be one of"):
        SigLipLoss(dist_impl="ring")
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        SigLipLoss(rank=2, world_size=2)
    x = F.normalize(torch.randn(4, 8), dim=-1)
    with pytest.raises(ValueError, match="4 images but 3 texts"):
        SigLipLoss()(x, x[:3], torch.tensor(10.0), torch.tensor(-10.0))
    with pytest.raises(RuntimeError, match="initialize the process group first"):
        SigLipLoss(rank=0, world_size=2)(x, x, torch.tensor(10.0), torch.tensor(-10.0))


def model_reference(switchback: bool):
    model = CLIPForContrastive(tiny_model(switchback=switchback, siglip=True))
    loss = contrastive_backward(model, SigLipLoss(), [fixed_batch(4 * WORLD)], Accelerator(cpu=True))
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def max_error(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_four_process_siglip_loss_and_grads_equal_single_process(tmp_path):
    launch([WORKER, "--out", str(tmp_path)], num_processes=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    # float64 features: every dist_impl, equal batches and an uneven last batch, exact to rounding
    g = torch.Generator().manual_seed(0)
    features = {
        k: F.normalize(torch.randn(4 * WORLD, 8, generator=g, dtype=torch.float64), dim=-1) for k in "it"
    }
    for sizes in ((4,) * WORLD, (4,) * (WORLD - 1) + (1,)):
        n = sum(sizes)
        image, text = (features[k][:n].clone().requires_grad_() for k in "it")
        scale = torch.tensor(10.0, dtype=torch.float64, requires_grad=True)
        bias = torch.tensor(-5.0, dtype=torch.float64, requires_grad=True)
        ref = sigmoid_loss(image, text, scale, bias)
        ref.backward()
        for impl in DIST_IMPLS:
            got = ranks[0][("features", sizes, impl)]
            assert abs(got["loss"] - ref.item()) <= 1e-9, (sizes, impl)
            assert abs(got["scale_grad"] - scale.grad.item()) <= 1e-9, (sizes, impl)
            assert abs(got["bias_grad"] - bias.grad.item()) <= 1e-9, (sizes, impl)
            image_grad = torch.cat([r[("features", sizes, impl)]["image_grad"] for r in ranks])
            text_grad = torch.cat([r[("features", sizes, impl)]["text_grad"] for r in ranks])
            assert (image_grad - image.grad).abs().max() <= 1e-9, (sizes, impl)
            assert (text_grad - text.grad).abs().max() <= 1e-9, (sizes, impl)

    # A SiglipModel under DDP. fp32: only the order of summation differs (1e-5). SwitchBack int8 quantizes
    # inputs and output gradients per token and weights per tensor, so a rank's rows quantize as they would in
    # the whole batch; but the float-order differences of the loss gradient can move an output-gradient entry
    # across an int8 rounding boundary (1/127 of its row's absmax). Seen: 3e-5 on a gradient of magnitude 0.16
    # (2e-4 relative). Stated bound: each gradient within 1e-3 of its tensor's largest entry.
    for switchback in (False, True):
        ref_loss, ref_grads = model_reference(switchback)
        for impl, accum_freq in [(impl, 1) for impl in DIST_IMPLS] + [("bidir", 2)]:
            got = ranks[0][("model", switchback, impl, accum_freq)]
            case = (switchback, impl, accum_freq)
            assert abs(got["loss"] - ref_loss) <= 1e-5, case
            if not switchback:
                assert max_error(got["grads"], ref_grads) <= 1e-5, case
                continue
            assert got["grads"].keys() == ref_grads.keys()
            for name, ref in ref_grads.items():
                bound = 1e-3 * ref.abs().max().item() + 1e-7
                assert (got["grads"][name] - ref).abs().max() <= bound, (case, name)
