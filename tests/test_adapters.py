"""The private-state accessors in hf_switchback/adapters: each works against the installed library, and each
fails loudly (or takes its documented fallback) when the private attribute it reads is gone."""

from __future__ import annotations

import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hf_switchback.adapters.accelerate import accelerator_mixed_precision, init_process_group_kwargs
from hf_switchback.adapters.fsdp2 import retarget_fsdp_modules

# ---------------------------------------------------------------------------------------------------- FSDP2


@pytest.fixture
def sharded(tmp_path):
    """A two-linear model under fully_shard in a one-process gloo group on the CPU."""
    if not dist.is_available():
        pytest.skip("torch built without torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        yield model
    finally:
        dist.destroy_process_group()


def _records(model):
    # Reads the same private state as the adapter, to check what it wrote.
    return [p._module_info for g in model._get_fsdp_state()._fsdp_param_groups for p in g.fsdp_params]


def test_fsdp2_records_follow_the_replacement(sharded):
    old, new = sharded[0], nn.Linear(8, 8)
    assert any(info.module is old for info in _records(sharded))
    retarget_fsdp_modules(sharded, {id(old): new})
    modules = [info.module for info in _records(sharded)]
    assert new in modules and old not in modules
    assert modules.count(sharded[1]) == 2  # the untouched layer's weight and bias keep their record


def test_fsdp2_older_single_group_layout_is_read(sharded, monkeypatch):
    group = sharded._get_fsdp_state()._fsdp_param_groups[0]
    old_layout = types.SimpleNamespace(_fsdp_param_group=group)
    monkeypatch.setattr(type(sharded), "_get_fsdp_state", lambda self: old_layout)
    new = nn.Linear(8, 8)
    retarget_fsdp_modules(sharded, {id(sharded[0]): new})
    assert any(p._module_info.module is new for p in group.fsdp_params)


def test_fsdp2_missing_param_groups_raise(sharded, monkeypatch):
    monkeypatch.setattr(type(sharded), "_get_fsdp_state", lambda self: types.SimpleNamespace())
    with pytest.raises(
        RuntimeError, match=r"_fsdp_param_groups is missing.*Apply SwitchBack before fully_shard"
    ):
        retarget_fsdp_modules(sharded, {})


def test_fsdp2_missing_module_info_raises(sharded, monkeypatch):
    fsdp_param = sharded._get_fsdp_state()._fsdp_param_groups[0].fsdp_params[0]
    monkeypatch.delattr(fsdp_param, "_module_info")
    with pytest.raises(RuntimeError, match="_module_info"):
        retarget_fsdp_modules(sharded, {})


def test_fsdp2_plain_model_is_untouched():
    retarget_fsdp_modules(nn.Sequential(nn.Linear(2, 2)), {})  # no fully_shard: nothing to read, no error


# ---------------------------------------------------------------------------------------------------- accelerate


def test_accelerate_mixed_precision_is_read_from_the_shared_state(monkeypatch):
    from accelerate.state import AcceleratorState

    monkeypatch.delitem(AcceleratorState._shared_state, "_mixed_precision", raising=False)
    assert accelerator_mixed_precision() is None
    monkeypatch.setitem(AcceleratorState._shared_state, "_mixed_precision", "fp8")
    assert accelerator_mixed_precision() == "fp8"


def test_accelerate_without_shared_state_warns_and_falls_back(monkeypatch):
    import accelerate.state

    from hf_switchback.accelerate_fp8 import accelerate_fp8_enabled

    monkeypatch.setattr(accelerate.state, "AcceleratorState", type("AcceleratorState", (), {}))
    with pytest.warns(RuntimeWarning, match="_shared_state"):
        assert accelerator_mixed_precision() is None
    monkeypatch.setenv(
        "ACCELERATE_MIXED_PRECISION", "fp8"
    )  # the fallback: the launcher's variable still counts
    assert accelerate_fp8_enabled()


@pytest.mark.parametrize("minutes", [10, 30])
def test_accelerate_timeout_always_passed_on(minutes):
    handler = init_process_group_kwargs(timedelta(minutes=minutes))
    assert handler.to_kwargs() == {"timeout": timedelta(minutes=minutes)}
    # accelerate's own to_kwargs is kept wherever it passes the timeout on (it drops only its 10 min default)
    assert ("to_kwargs" in vars(handler)) == (minutes == 10)


def test_accelerate_without_to_kwargs_raises(monkeypatch):
    from accelerate.utils.dataclasses import KwargsHandler

    monkeypatch.delattr(KwargsHandler, "to_kwargs")
    with pytest.raises(RuntimeError, match="to_kwargs"):
        init_process_group_kwargs(timedelta(minutes=10))


# ---------------------------------------------------------------------------------------------------- bitsandbytes


def _stepped_bnb_state(min_8bit_size: int) -> tuple[dict, torch.Tensor]:
    """One AdamW8bit step on a 64x128 weight: its state, and the second moment torch computes, (1-β2)·g²."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64, 128))
    p.grad = torch.randn(64, 128)
    opt = bnb.optim.AdamW8bit([p], lr=1e-3, betas=(0.9, 0.95), min_8bit_size=min_8bit_size)
    opt.step()
    return opt.state[p], (1 - 0.95) * p.grad.square()


def test_bnb_second_moment_32bit_state_is_exact():
    from hf_switchback.adapters.bitsandbytes import second_moment

    state, expected = _stepped_bnb_state(min_8bit_size=10**9)
    torch.testing.assert_close(second_moment(state), expected, rtol=1e-6, atol=0)


def test_bnb_second_moment_8bit_state_dequantizes():
    from hf_switchback.adapters.bitsandbytes import second_moment

    state, expected = _stepped_bnb_state(min_8bit_size=1)
    assert state["state2"].dtype == torch.uint8
    v = second_moment(state)
    # block-wise dynamic 8-bit quantization: a few percent of error overall
    assert v.dtype == torch.float32 and (v - expected).norm() / expected.norm() < 0.05


def test_bnb_missing_state_keys_raise():
    from hf_switchback.adapters.bitsandbytes import second_moment

    state, _ = _stepped_bnb_state(min_8bit_size=1)
    with pytest.raises(RuntimeError, match="absmax2"):
        second_moment({k: v for k, v in state.items() if k != "absmax2"})
    with pytest.raises(RuntimeError, match="state2"):
        second_moment({"step": 1})


def test_bnb_optimizer_hooks_are_checked(monkeypatch):
    bnb = pytest.importorskip("bitsandbytes")
    from hf_switchback.adapters.bitsandbytes import check_optimizer_hooks
    from hf_switchback.training import optim

    check_optimizer_hooks(bnb.optim.AdamW8bit)  # the installed version has both hooks
    monkeypatch.delattr(bnb.optim.optimizer.Optimizer8bit, "get_config")
    with pytest.raises(RuntimeError, match="get_config is missing"):
        optim._bnb_classes.__wrapped__()  # uncached: what the first 8-bit optimizer of a run would do
