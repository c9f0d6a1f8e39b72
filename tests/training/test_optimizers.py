"""create_optimizer: wiring (groups, hyperparameters, 32-bit overrides), StableAdamW against the paper's formula,
8-bit states on CPU and their size."""

import copy
import math

import pytest
import torch
from torch import nn

from hf_switchback.training.optim import (
    OPTIMIZER_CHOICES,
    create_optimizer,
    unstable_parameters,
)

LR, BETAS, EPS = 1e-2, (0.9, 0.98), 1e-6

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer state tensors; shared tensors (bitsandbytes' quantization maps) count once."""
    seen, total = set(), 0
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
    return total


def test_choices_and_defaults():
    """The training script's optimizer flags default to a known choice and to what the README's stability recipe
    states (OpenCLIP's ViT betas and eps; lr 2e-3, weight decay 0.1); an unknown name is refused."""
    from hf_switchback.training import cli

    parser = cli.build_parser()
    assert parser.get_default("optimizer") in OPTIMIZER_CHOICES
    args = parser.parse_args([])
    assert (args.beta1, args.beta2, args.eps, args.lr, args.weight_decay) == (0.9, 0.98, 1e-6, 2e-3, 0.1)
    with pytest.raises(ValueError, match="not one of"):
        create_optimizer("sgd", [{"params": [nn.Parameter(torch.ones(2))]}], lr=LR, betas=BETAS, eps=EPS)


@pytest.mark.parametrize("name", OPTIMIZER_CHOICES)
def test_param_groups_weight_decay_and_lr_respected(name):
    # With an all-zero gradient Adam's moments stay 0, so the update is weight decay alone:
    # p <- p * (1 - lr * wd) in the decayed group, p unchanged in the no-decay group and in the lr=0 group.
    # Tensors of 64x128 elements go through the 8-bit path of the bitsandbytes optimizers.
    decayed = nn.Parameter(torch.randn(64, 128))
    no_decay = nn.Parameter(torch.randn(128))
    frozen_lr = nn.Parameter(torch.randn(64, 128))
    before = [t.detach().clone() for t in (decayed, no_decay, frozen_lr)]
    groups = [
        {"params": [decayed], "weight_decay": 0.2},
        {"params": [no_decay], "weight_decay": 0.0},
        {"params": [frozen_lr], "weight_decay": 0.2, "lr": 0.0},
    ]
    opt = create_optimizer(name, groups, lr=LR, betas=BETAS, eps=EPS)
    for p in (decayed, no_decay, frozen_lr):
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(decayed.detach(), before[0] * (1 - LR * 0.2), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(no_decay.detach(), before[1], rtol=0, atol=0)
    torch.testing.assert_close(frozen_lr.detach(), before[2], rtol=0, atol=0)
    # the shared hyperparameters reached every group, under whichever keys the library uses
    for g in opt.param_groups:
        assert g.get("betas", (g.get("beta1"), g.get("beta2")))[:2] in (BETAS, list(BETAS))
        assert g["eps"] == EPS


def _paper_stableadamw(p0, grads, *, lr, beta1, beta2, eps, wd, clip=True):
    """StableAdamW as written in Wortsman et al. 2023, Algorithm 2, in float64 (``clip=False``: plain AdamW with
    the same debiasing). Returns the parameter after every step and the RMS_t of every step."""
    theta = p0.double().clone()
    m = torch.zeros_like(theta)
    v = torch.zeros_like(theta)
    params, rmss = [], []
    for t, g in enumerate(grads, start=1):
        g = g.double()
        b1 = (
            beta1 * (1 - beta1 ** (t - 1)) / (1 - beta1**t)
        )  # debiased betas: m, v are the bias-corrected moments
        b2 = beta2 * (1 - beta2 ** (t - 1)) / (1 - beta2**t)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        rms = math.sqrt((g * g / torch.clamp(v, min=eps**2)).mean().item())
        eta = lr / max(1.0, rms) if clip else lr
        theta = theta - eta * wd * theta - eta * m / (v.sqrt() + eps)
        params.append(theta.clone())
        rmss.append(rms)
    return params, rmss


def _gradient_history(shape, steps=12, spike_at=8):
    """Smooth gradients of scale 1e-2, then one step 30x larger: v̂ lags it, RMS_t > 1, the clip branch."""
    gen = torch.Generator().manual_seed(1)
    grads = [1e-2 * torch.randn(shape, generator=gen) for _ in range(steps)]
    grads[spike_at] = grads[spike_at] * 30
    return grads


@pytest.mark.parametrize(
    ("name", "min_8bit_size", "rtol"),
    [
        ("stableadamw", None, 1e-4),  # torch-optimi
        # ours on bitsandbytes' 32-bit-state kernel (tensor below min_8bit_size); bitsandbytes adds eps to the
        # un-corrected sqrt(v) (eps·sqrt(1-β2^t) in bias-corrected terms), a ~1e-4 relative difference here
        ("stableadamw8bit", 1 << 30, 1e-3),
    ],
)
def test_stableadamw_matches_paper_formula(name, min_8bit_size, rtol):
    """Per-step updates Δθ_t equal Algorithm 2's to ``rtol`` (relative, plus rtol·lr absolute)."""
    shape, wd = (16, 24), 0.1
    grads = _gradient_history(shape)
    p0 = torch.randn(shape)
    ref_params, ref_rms = _paper_stableadamw(p0, grads, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, wd=wd)
    ref_updates = [b - a for a, b in zip([p0.double(), *ref_params[:-1]], ref_params, strict=True)]
    # the history exercises both branches: no clipping (RMS < 1) and clipping (RMS > 1) ...
    spike = ref_rms.index(max(ref_rms))
    assert ref_rms[spike] > 2 and min(ref_rms) < 1
    # ... and at the spike the clipped update differs from the unclipped one by far more than the tolerance,
    # so a library that skipped the clipping would fail below
    unclipped, _ = _paper_stableadamw(
        p0, grads, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, wd=wd, clip=False
    )
    unclipped_update = unclipped[spike] - ref_params[spike - 1]  # same starting point as ref_updates[spike]
    assert (unclipped_update - ref_updates[spike]).abs().max() > 100 * rtol * LR

    p = nn.Parameter(p0.clone())
    kwargs = {} if min_8bit_size is None else {"min_8bit_size": min_8bit_size}
    opt = create_optimizer(name, [{"params": [p], "weight_decay": wd}], lr=LR, betas=BETAS, eps=EPS, **kwargs)
    for t, g in enumerate(grads):
        before = p.detach().double().clone()
        p.grad = g.clone()
        opt.step()
        update = p.detach().double() - before
        torch.testing.assert_close(update, ref_updates[t], rtol=rtol, atol=rtol * LR, msg=f"step {t + 1}")


def test_stableadamw_clipping_branch_differs_from_adamw():
    """The same history through plain AdamW ends far from StableAdamW: the clipped step is what differs."""
    grads = _gradient_history((16, 24))
    p0 = torch.randn(16, 24)
    finals = {}
    for name in ("adamw", "stableadamw"):
        p = nn.Parameter(p0.clone())
        opt = create_optimizer(name, [{"params": [p], "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=EPS)
        for g in grads[:9]:  # up to and including the spike
            p.grad = g.clone()
            opt.step()
        finals[name] = p.detach()
    ref, _ = _paper_stableadamw(p0, grads[:9], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, wd=0.0)
    torch.testing.assert_close(finals["stableadamw"].double(), ref[-1], rtol=2e-5, atol=2e-7)
    assert (finals["adamw"] - finals["stableadamw"]).abs().max() > 0.2 * LR


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit", "stableadamw8bit"])
def test_8bit_steps_on_cpu_and_state_is_smaller(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 128), nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    data = torch.randint(0, 64, (16, 4))

    def run(opt_name, **kwargs):
        m = copy.deepcopy(model)
        groups = [{"params": list(m.parameters()), "weight_decay": 0.0}]
        if "keep_32bit" in kwargs:
            kwargs["keep_32bit"] = unstable_parameters(m)
        opt = create_optimizer(opt_name, groups, lr=1e-3, betas=BETAS, eps=EPS, **kwargs)
        losses = []
        for _ in range(5):
            loss = m(data).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return m, opt, losses

    m32, opt32, _ = run("adamw")
    m8, opt8, losses8 = run(name, keep_32bit=None)
    assert all(math.isfinite(x) for x in losses8)
    assert losses8[-1] < losses8[0]  # it trains
    # After 5 small steps the 8-bit run stays close to fp32 AdamW (quantized states, same algorithm).
    for p8, p32, p0 in zip(m8.parameters(), m32.parameters(), model.parameters(), strict=True):
        moved = (p32 - p0).norm()
        assert (p8 - p32).norm() < 0.2 * moved
    # 8-bit states: the two Linear weights (32768 elements each) quantized; the embedding (keep_32bit, 8192
    # elements) and biases (below min_8bit_size) keep fp32. State bytes measured, not computed from theory.
    state8 = opt8.state
    assert state8[m8[1].weight]["state1"].dtype == torch.uint8
    assert state8[m8[0].weight]["state1"].dtype == torch.float32
    assert state8[m8[1].bias]["state1"].dtype == torch.float32
    bytes32, bytes8 = _state_bytes(opt32), _state_bytes(opt8)
    assert bytes8 < 0.45 * bytes32, (bytes8, bytes32)


def test_keep_32bit_is_per_optimizer():
    # Overrides are scoped to the optimizer that got them (bitsandbytes' GlobalOptimManager is process-wide).
    w = nn.Parameter(torch.randn(128, 64))
    a = create_optimizer("adamw8bit", [{"params": [w]}], lr=LR, betas=BETAS, eps=EPS, keep_32bit=[w])
    b = create_optimizer("adamw8bit", [{"params": [w]}], lr=LR, betas=BETAS, eps=EPS)
    w.grad = torch.randn_like(w)
    a.step()
    b.step()
    assert a.state[w]["state1"].dtype == torch.float32
    assert b.state[w]["state1"].dtype == torch.uint8
