"""SpikeMonitor: RMS(g²/v̂) against a hand-tracked second moment, spike flagged, smooth run quiet, plot written."""

import logging

import pytest
import torch
from torch import nn

from hf_switchback.training.optim import create_optimizer
from hf_switchback.training.spike_monitor import SpikeMonitor, default_group_name

BETAS, EPS = (0.9, 0.99), 1e-8

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 64))


def _train(monitor_kwargs=None, optimizer="adamw", steps=60, spike_at=None, lr=1e-3):
    """Regression on a fixed random target with fresh batches; optionally scale all grads 100x at one step."""
    model = _model()
    target = nn.Linear(16, 64)
    opt = create_optimizer(
        optimizer, [{"params": list(model.parameters()), "weight_decay": 0.0}], lr=lr, betas=BETAS, eps=EPS
    )
    monitor = SpikeMonitor(model, opt, **(monitor_kwargs or {}))
    metrics = []
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(64, 16, generator=gen)
        loss = (model(x) - target(x).detach()).square().mean()
        loss.backward()
        if step == spike_at:
            for p in model.parameters():
                p.grad.mul_(100.0)
        opt.step()
        metrics.append(monitor.update(step, loss.item()))
        opt.zero_grad()
    return model, opt, monitor, metrics


def test_rms_matches_hand_tracked_second_moment():
    """Track v_t = β2 v + (1-β2) g² ourselves in float64; RMS = sqrt(mean(g² / (v_t / (1-β2^t))))."""
    model = _model()
    opt = create_optimizer("adamw", [{"params": list(model.parameters())}], lr=1e-3, betas=BETAS, eps=EPS)
    monitor = SpikeMonitor(model, opt)
    v = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    for t in range(1, 8):
        model(torch.randn(32, 16)).square().mean().backward()
        if t == 6:
            model[0].weight.grad.mul_(20.0)  # a spike, so the values are not all ≈1
        opt.step()
        got = monitor.tensor_rms()
        if t == 6:
            assert got["0.weight"] > 2  # the spike step reads high (steady state ≈ 1)
        for n, p in model.named_parameters():
            g = p.grad.double()
            v[n] = BETAS[1] * v[n] + (1 - BETAS[1]) * g * g
            expected = (g * g / (v[n] / (1 - BETAS[1] ** t))).mean().sqrt().item()
            assert got[n] == pytest.approx(expected, rel=1e-5), (t, n)
        opt.zero_grad()


@pytest.mark.parametrize(
    ("optimizer", "rel"), [("stableadamw", 1e-5), ("adamw8bit", 0.05), ("stableadamw8bit", 0.05)]
)
def test_other_optimizer_states_read_the_same(optimizer, rel):
    """torch-optimi (debiased state) and bitsandbytes (8-bit block-wise state) give AdamW's values.

    lr=0 keeps the parameters, hence the gradient history, identical across optimizers: only the state differs."""
    _, _, ref, _ = _train(optimizer="adamw", steps=12, spike_at=10, lr=0.0)
    _, _, other, _ = _train(optimizer=optimizer, steps=12, spike_at=10, lr=0.0)
    assert max(ref.max_rms) > 3
    assert other.max_rms == pytest.approx(ref.max_rms, rel=rel)


def test_flags_injected_spike(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_switchback.training.spike_monitor"):
        _, _, monitor, metrics = _train(spike_at=40)
    assert [w[0] for w in monitor.warnings] == [40]
    assert "step 40" in caplog.text and "exceeds" in caplog.text
    assert metrics[40]["rms/max"] > monitor.threshold
    assert max(metrics[39][k] for k in metrics[39] if k != "rms/max") < monitor.threshold
    # per-layer keys for the trackers
    assert {"rms/0", "rms/2", "rms/max"} == set(metrics[40])


def test_quiet_on_smooth_run(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_switchback.training.spike_monitor"):
        _, _, monitor, _ = _train()
    assert monitor.warnings == []
    assert "exceeds" not in caplog.text
    assert max(monitor.max_rms) < monitor.threshold
    assert len(monitor.losses) == 60 and monitor.losses[-1] < monitor.losses[0]


def test_every_n_steps():
    _, _, monitor, metrics = _train(monitor_kwargs={"every": 5}, steps=20)
    assert monitor.rms_steps == [0, 5, 10, 15]
    assert len(monitor.losses) == 20
    assert metrics[1] == {}


def test_plot_written(tmp_path):
    _, _, monitor, _ = _train(spike_at=30, steps=40)
    path = tmp_path / "spike_monitor.png"
    monitor.save_plot(str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_group_names():
    assert default_group_name("text_model.encoder.layers.3.mlp.fc1.weight") == "text_model.layers.3"
    assert default_group_name("vision_model.embeddings.patch_embedding.weight") == "vision_model.embeddings"
    assert default_group_name("logit_scale") == "logit_scale"


def test_rejects_optimi_foreach():
    from optimi import StableAdamW

    model = _model()
    with pytest.raises(ValueError, match="foreach"):
        SpikeMonitor(model, StableAdamW(model.parameters(), lr=1e-3, foreach=True))


def test_rejects_optimizers_without_a_second_moment():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="second moment"):
        SpikeMonitor(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
