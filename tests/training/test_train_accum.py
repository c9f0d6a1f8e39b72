"""OpenCLIP-style gradient accumulation: accum_freq=4 x batch b == accum_freq=1 x batch 4b."""

import pytest
from accelerate import Accelerator
from train_helpers import fixed_batch, tiny_model

from hf_switchback.training import ClipLoss
from hf_switchback.training.step import CLIPForContrastive, contrastive_backward


def grads_after(micro_batches, switchback: bool):
    model = CLIPForContrastive(tiny_model(switchback=switchback))
    loss = contrastive_backward(model, ClipLoss(), micro_batches, Accelerator(cpu=True))
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("switchback", [False, True])
def test_accum_freq_4_equals_one_big_batch(switchback):
    batch = fixed_batch(16)
    micro = [{k: v[i * 4 : (i + 1) * 4] for k, v in batch.items()} for i in range(4)]
    big_loss, big = grads_after([batch], switchback)
    acc_loss, acc = grads_after(micro, switchback)
    assert abs(big_loss - acc_loss) <= 1e-5
    for name in big:
        err = (big[name] - acc[name]).abs().max().item()
        assert err <= 1e-5 * max(1.0, big[name].abs().max().item()), (name, err)


def test_per_micro_batch_losses_differ_from_full_batch():
    """What accelerator.accumulate would compute (each micro-batch its own negatives) is NOT the same."""
    batch = fixed_batch(16)
    _, big = grads_after([batch], False)
    naive = CLIPForContrastive(tiny_model())
    for i in range(4):
        mb = {k: v[i * 4 : (i + 1) * 4] for k, v in batch.items()}
        (ClipLoss()(*naive(**mb)) / 4).backward()
    worst = max((big[n] - p.grad).abs().max().item() for n, p in naive.named_parameters())
    assert worst > 1e-4
