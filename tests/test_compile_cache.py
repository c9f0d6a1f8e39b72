"""allow_compile_cache: a SwitchBack layer's compiled graph comes back from AOT autograd's disk cache.

A real Inductor compile on the CPU (torch backend), twice on one cache folder with Dynamo's in-memory state reset
between: the second compile must load the graph (hit) with the setting and re-trace it (bypass) without. No
autocast here: torch 2.13's AOT autograd cache refuses any graph with an autocast region, whatever the setting
(torch 2.11 on the H100 took the compiled layers of a bf16-autocast training step from it, BENCHMARKS.md).
"""

import shutil

import pytest
import torch
import torch._functorch.config as functorch_config

from hf_switchback import SwitchBackConfig, SwitchBackLinear
from hf_switchback.compile_cache import allow_compile_cache

needs_cxx = pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")),
    reason="Inductor on the CPU needs a C++ compiler (c++ or g++ on PATH)",
)


@pytest.fixture(autouse=True)
def _torch_default(monkeypatch):
    """Each test starts from torch's default setting; the process's own comes back afterwards."""
    monkeypatch.delenv("TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD", raising=False)
    with functorch_config.patch(autograd_cache_allow_custom_autograd_functions=False):
        yield


def _aot_cache_outcomes(cache_dir, monkeypatch) -> list[dict[str, int]]:
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    torch.manual_seed(0)
    layer = SwitchBackLinear(32, 16, config=SwitchBackConfig(backend="torch", min_tokens=0))
    x = torch.randn(64, 32)
    outcomes, results = [], []
    for _ in range(2):
        torch._dynamo.reset()  # forget the compiled code in memory; the disk cache stays
        before = dict(counters["aot_autograd"])
        out = torch.compile(layer, fullgraph=True)(x)
        out.square().sum().backward()
        results.append((out.detach(), layer.weight.grad.clone()))
        layer.weight.grad = None
        after = counters["aot_autograd"]
        outcomes.append(
            {k: after[k] - before.get(k, 0) for k in ("autograd_cache_hit", "autograd_cache_bypass")}
        )
    torch._dynamo.reset()
    for got, expect in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, expect, rtol=0, atol=0)  # the cached graph computes the same
    return outcomes


@needs_cxx
def test_switchback_layer_comes_back_from_the_compile_cache_when_allowed(tmp_path, monkeypatch):
    assert allow_compile_cache()
    first, second = _aot_cache_outcomes(tmp_path, monkeypatch)
    assert first == {"autograd_cache_hit": 0, "autograd_cache_bypass": 0}
    assert second == {"autograd_cache_hit": 1, "autograd_cache_bypass": 0}


@needs_cxx
def test_without_it_torch_retraces_the_switchback_layer(tmp_path, monkeypatch):
    # torch's default: the reason allow_compile_cache exists (if this starts hitting, torch changed its default)
    first, second = _aot_cache_outcomes(tmp_path, monkeypatch)
    assert first["autograd_cache_bypass"] == 1 and second == {
        "autograd_cache_hit": 0,
        "autograd_cache_bypass": 1,
    }


def test_train_clip_compile_allows_the_cache_and_plain_runs_leave_torch_alone(monkeypatch):
    from argparse import Namespace

    from hf_switchback.training.runtime import dynamo_plugin

    assert dynamo_plugin(Namespace(torch_compile=False, compile_mode=None)) is None
    assert functorch_config.autograd_cache_allow_custom_autograd_functions is False
    assert dynamo_plugin(Namespace(torch_compile=True, compile_mode=None)) is not None
    assert functorch_config.autograd_cache_allow_custom_autograd_functions is True
