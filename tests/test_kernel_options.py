"""KernelOptions: data each layer carries (not process-wide switches), kept out of config.json, validated."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from helpers import HAS_TRITON, KernelSpy, tiny_clip_config
from torch import nn

from hf_switchback import KernelOptions, SwitchBackConfig, SwitchBackLinear, apply_switchback
from hf_switchback.kernels import library, reference
from hf_switchback.kernels.options import TMA_ENV


def test_defaults_are_the_measured_ones_and_the_env_var_only_seeds_use_tma(monkeypatch):
    monkeypatch.delenv(TMA_ENV, raising=False)
    assert KernelOptions() == KernelOptions(
        fused_bias_grad=True,
        fuse_quantize_under_compile=True,
        trace_gemm=True,
        triton_grad_quantize=True,
        triton_act_quantize=True,
        direct_eager=True,
        act_backward_impl="auto",
        use_tma=False,
    )
    monkeypatch.setenv(TMA_ENV, "1")
    assert KernelOptions().use_tma is True
    assert KernelOptions(use_tma=False).use_tma is False  # an explicit value wins over the environment
    monkeypatch.setenv(TMA_ENV, "yes")
    with pytest.raises(ValueError, match=f"{TMA_ENV} must be 0 or 1, got 'yes'"):
        KernelOptions()


def test_bad_values_are_refused_by_field_name():
    with pytest.raises(ValueError, match=r"act_backward_impl must be one of .*got 'row'"):
        KernelOptions(act_backward_impl="row")
    with pytest.raises(TypeError, match=r"KernelOptions\.use_tma must be a bool, got int"):
        KernelOptions(use_tma=1)
    with pytest.raises(TypeError, match=r"kernel_options must be a hf_switchback\.KernelOptions, got dict"):
        SwitchBackConfig(kernel_options={"use_tma": True})
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelOptions().use_tma = True


def test_kernel_options_stay_out_of_config_json_and_of_config_equality():
    options = KernelOptions(use_tma=True, act_backward_impl="tiles")
    cfg = SwitchBackConfig(weight_scaling="row", kernel_options=options)
    saved = cfg.to_dict()
    assert "kernel_options" not in saved
    loaded = SwitchBackConfig.from_dict(saved)
    assert loaded.kernel_options == KernelOptions()  # a run-time choice: the loading process picks its own
    assert loaded == cfg and hash(loaded) == hash(cfg)  # the same quantization
    given = SwitchBackConfig.from_dict({**saved, "kernel_options": {"use_tma": True}})
    assert given.kernel_options == KernelOptions(use_tma=True)


def test_every_kernel_set_takes_the_options_with_the_reference_signatures():
    """Every kernel set (the reference set and, where triton imports, the Triton sets) has one function per
    declared operator, with its twin's parameters, `options` last."""
    assert len(library.OP_NAMES) == 16
    sets = [library.REFERENCE]
    if HAS_TRITON:
        from hf_switchback.kernels import compiled, ops

        sets += [ops.KERNELS, compiled.KERNELS]
    for name in library.OP_NAMES:
        want = list(inspect.signature(getattr(reference, name)).parameters)
        assert want[-1] == "options", name
        for kernel_set in sets:
            assert list(inspect.signature(getattr(kernel_set, name)).parameters) == want, (kernel_set, name)


def _clip_step(model, optimizer, batch) -> None:
    loss = model(**batch, return_loss=True).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_two_models_with_different_kernel_options_train_in_one_process(monkeypatch):
    """Each model's layers hand their own options to every kernel call, step after step, interleaved; the
    option that matters on the torch path (fused_bias_grad) takes its code path in each."""
    spy = KernelSpy.install(monkeypatch)
    models, optimizers = {}, {}
    for fused in (True, False):
        options = KernelOptions(fused_bias_grad=fused, act_backward_impl="tiles" if fused else "rows")
        cfg = SwitchBackConfig(backend="torch", kernel_options=options)
        torch.manual_seed(0)
        models[fused] = apply_switchback(_tiny_clip(), cfg)
        optimizers[fused] = torch.optim.SGD(models[fused].parameters(), lr=0.1)
    before = {k: [p.detach().clone() for p in m.parameters()] for k, m in models.items()}
    batch = dict(
        input_ids=torch.randint(2, 64, (4, 8)),
        attention_mask=torch.ones(4, 8, dtype=torch.long),
        pixel_values=torch.randn(4, 3, 16, 16),
    )
    for _ in range(2):
        for fused in (True, False):
            options = models[fused].text_model.encoder.layers[0].mlp.fc1.switchback_config.kernel_options
            spy.calls.clear()
            _clip_step(models[fused], optimizers[fused], batch)
            assert spy.calls and all(got is options for _, got in spy.calls), fused
            names = spy.names()
            assert ("quantize_rowwise_colsum" in names) == fused  # every swapped linear has a bias
    for fused, model in models.items():
        moved = [not torch.equal(p, p0) for p, p0 in zip(model.parameters(), before[fused], strict=True)]
        assert all(moved) and all(torch.isfinite(p).all() for p in model.parameters())


def _tiny_clip():
    from transformers import CLIPModel

    return CLIPModel(tiny_clip_config(layers=1))


@pytest.mark.gpu
def test_two_models_with_different_kernel_options_train_on_the_gpu(monkeypatch):
    """GPU: one model on the TMA GEMM, one on the portable kernel, one process. On Hopper the first model's
    GEMMs (M >= 1024) go through the TMA launcher and the second's never do; both train to the same
    gradients up to quantization-tie noise."""
    from hf_switchback.kernels import matmul

    tma_calls = []
    run_tma = matmul._run_tma
    monkeypatch.setattr(matmul, "_run_tma", lambda *a: tma_calls.append(a[0].shape) or run_tma(*a))
    x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grads = {}
    for use_tma in (True, False, True):
        # fp8_gemm="triton": every GEMM on our kernels (on Hopper "auto" sends the fp8 gradient GEMMs to cuBLAS)
        options = KernelOptions(use_tma=use_tma, fp8_gemm="triton")
        cfg = SwitchBackConfig(backend="triton", min_tokens=0, kernel_options=options)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
        model = nn.Sequential(
            *(SwitchBackLinear.from_linear(m, cfg) if isinstance(m, nn.Linear) else m for m in model)
        )
        model = model.to("cuda", torch.bfloat16)
        tma_calls.clear()
        model(x).float().pow(2).mean().backward()
        hopper = torch.cuda.get_device_capability()[0] == 9
        # 2 forward + 2 grad-input GEMMs, all with M = 2048 rows: TMA-eligible on Hopper
        assert len(tma_calls) == (4 if use_tma and hopper else 0), (use_tma, tma_calls)
        grads[use_tma] = [x.grad.float()] + [p.grad.float() for p in model.parameters()]
        x.grad = None
    for a, b in zip(grads[True], grads[False], strict=True):
        assert ((a - b).pow(2).mean() / b.pow(2).mean()).item() < 1e-3
