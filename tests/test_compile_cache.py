"""allow_compile_cache and graph leaves: a SwitchBack layer's compiled graph comes back from AOT autograd's disk cache.
save_compile_artifacts / load_compile_artifacts: a second process with empty caches (another node, a fresh
container) gets every graph of the first one from the saved file; a bad file only warns.

A real Inductor compile on the CPU (torch backend), twice on one cache folder with Dynamo's in-memory state reset
between: the second compile must load the graph (hit). Under bf16 autocast too: torch 2.13's AOT autograd cache
refuses any graph with an autocast region, and the SwitchBack ops turn autocast off inside their graph leaves,
where Dynamo does not see it.
"""

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._functorch.config as functorch_config

from hf_switchback import SwitchBackConfig, SwitchBackLinear
from hf_switchback.compile_cache import (
    allow_compile_cache,
    load_compile_artifacts,
    save_compile_artifacts,
    start_compile_workers,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")
STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"

needs_cxx = pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")),
    reason="Inductor on the CPU needs a C++ compiler (c++ or g++ on PATH)",
)


@pytest.fixture(autouse=True)
def _torch_default(monkeypatch):
    """Each test starts from torch's default setting; the process's own comes back afterwards."""
    import torch._inductor.config as inductor_config

    monkeypatch.delenv("TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD", raising=False)
    monkeypatch.delenv(STATIC_LAUNCH_ENV, raising=False)
    with (
        functorch_config.patch(autograd_cache_allow_custom_autograd_functions=False),
        inductor_config.patch(static_launch_user_defined_triton_kernels=False),
    ):
        yield
    os.environ.pop(STATIC_LAUNCH_ENV, None)  # allow_compile_cache sets it (monkeypatch saw it absent)


def _aot_cache_outcomes(cache_dir, monkeypatch, autocast: bool = False) -> list[dict[str, int]]:
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    torch.manual_seed(0)
    layer = SwitchBackLinear(32, 16, config=SwitchBackConfig(backend="torch", min_tokens=0))
    x = torch.randn(64, 32)
    outcomes, results = [], []
    for _ in range(2):
        torch._dynamo.reset()  # forget the compiled code in memory; the disk cache stays
        before = dict(counters["aot_autograd"])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = torch.compile(layer, fullgraph=True)(x)
        out.float().square().sum().backward()
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
def test_switchback_layer_comes_back_from_the_compile_cache_under_autocast(tmp_path, monkeypatch):
    assert allow_compile_cache()
    first, second = _aot_cache_outcomes(tmp_path, monkeypatch, autocast=True)
    assert first == {"autograd_cache_hit": 0, "autograd_cache_bypass": 0}
    assert second == {"autograd_cache_hit": 1, "autograd_cache_bypass": 0}


@needs_cxx
def test_the_switchback_layer_is_cached_without_it_keyed_by_the_package(tmp_path, monkeypatch):
    # The layer's op is a graph leaf (kernels/graph_leaf.py): no custom Function in Dynamo's graph, so torch's
    # default caches it, under the key of the package's files.
    import torch._inductor.config as inductor_config

    from hf_switchback.kernels import graph_leaf

    with inductor_config.patch(unsafe_marked_cacheable_functions={}):
        # no registration to redo: the marks go back into the patched setting at the next trace
        first, second = _aot_cache_outcomes(tmp_path, monkeypatch)
        marked = dict(inductor_config.unsafe_marked_cacheable_functions)
    assert first == {"autograd_cache_hit": 0, "autograd_cache_bypass": 0}
    assert second == {"autograd_cache_hit": 1, "autograd_cache_bypass": 0}
    key = graph_leaf.source_key()
    assert marked == {
        "hf_switchback.kernels.graph_leaf._leaf": key,
        "hf_switchback.kernels.options.KernelOptions": key,
        "hf_switchback.config.SwitchBackConfig": key,  # the whole-call leaves take it
    }


def test_train_clip_compile_allows_the_cache_and_plain_runs_leave_torch_alone(monkeypatch):
    from argparse import Namespace

    import torch._inductor.config as inductor_config

    from hf_switchback.training.runtime import dynamo_plugin

    assert dynamo_plugin(Namespace(torch_compile=False, compile_mode=None)) is None
    assert functorch_config.autograd_cache_allow_custom_autograd_functions is False
    assert inductor_config.static_launch_user_defined_triton_kernels is False
    assert dynamo_plugin(Namespace(torch_compile=True, compile_mode=None)) is not None
    assert functorch_config.autograd_cache_allow_custom_autograd_functions is True
    # a warm start loads our Triton kernels from the cache's cubins (compile_cache.py says why), and the compile
    # workers, which decide that for the kernels they compile, read it from their environment
    assert inductor_config.static_launch_user_defined_triton_kernels is True
    assert os.environ[STATIC_LAUNCH_ENV] == "1"


def test_allow_compile_cache_starts_the_compile_workers_after_setting_their_environment(monkeypatch):
    """With CUDA, Inductor's worker pool starts in allow_compile_cache (not at the first compile), after the
    variable its workers read is set; not with start_workers=False, nor without CUDA."""
    import torch._inductor.async_compile as async_compile

    started = []  # the static-launch variable each start saw
    monkeypatch.setattr(
        async_compile, "maybe_warm_pool", lambda: started.append(os.environ.get(STATIC_LAUNCH_ENV))
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    allow_compile_cache()
    assert started == ["1"]
    allow_compile_cache(start_workers=False)
    assert started == ["1"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    allow_compile_cache()
    assert not start_compile_workers()
    assert started == ["1"]


def test_allow_compile_cache_leaves_a_static_launch_choice_of_the_user(monkeypatch):
    monkeypatch.setenv(STATIC_LAUNCH_ENV, "0")
    allow_compile_cache()
    assert os.environ[STATIC_LAUNCH_ENV] == "0"


# One process of a run: load the previous run's artifacts (if any), compile a two-layer SwitchBack model, one
# training step, save the artifacts; prints the cache counters and the step's results as JSON.
_RUN = """
import json, sys, torch
from torch._dynamo.utils import counters
from hf_switchback import SwitchBackConfig, SwitchBackLinear
from hf_switchback.compile_cache import allow_compile_cache, load_compile_artifacts, save_compile_artifacts

path = sys.argv[1]
allow_compile_cache()
loaded = load_compile_artifacts(path)
torch.manual_seed(0)
config = SwitchBackConfig(backend="torch", min_tokens=0)
model = torch.nn.Sequential(
    SwitchBackLinear(32, 16, config=config), torch.nn.GELU(), SwitchBackLinear(16, 8, config=config)
)
out = torch.compile(model, fullgraph=True)(torch.randn(64, 32))
out.square().sum().backward()
print(json.dumps({
    "loaded": loaded,
    "saved": save_compile_artifacts(path),
    "aot": {k: counters["aot_autograd"][k] for k in ("autograd_cache_hit", "autograd_cache_miss")},
    "fx": {k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")},
    "results": [out.tolist(), model[0].weight.grad.tolist(), model[2].weight.grad.tolist()],
}))
"""


def _run_on_a_fresh_machine(path, caches) -> dict:
    ours = {
        "TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD",
        "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS",
    }
    env = {k: v for k, v in os.environ.items() if k not in ours}
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(caches),  # empty: nothing of the other process on this "machine"
        PYTHONPATH=os.pathsep.join([SRC, env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, str(path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_cxx
def test_saved_artifacts_warm_start_a_process_with_empty_caches(tmp_path):
    path = tmp_path / "shared" / "artifacts.bin"
    cold = _run_on_a_fresh_machine(path, tmp_path / "machine_a")
    assert cold["loaded"] is None  # no file yet: a first run
    assert cold["aot"] == {"autograd_cache_hit": 0, "autograd_cache_miss": 1}
    assert cold["fx"]["fxgraph_cache_hit"] == 0 and cold["fx"]["fxgraph_cache_miss"] >= 2  # forward, backward
    assert (
        cold["saved"]["aot_autograd"] == 1 and cold["saved"]["inductor"] == cold["fx"]["fxgraph_cache_miss"]
    )
    assert sorted(os.listdir(path.parent)) == ["artifacts.bin"]  # renamed into place, no temporary left

    warm = _run_on_a_fresh_machine(path, tmp_path / "machine_b")
    assert warm["loaded"] == cold["saved"]
    assert warm["aot"] == {"autograd_cache_hit": 1, "autograd_cache_miss": 0}  # nothing traced again
    assert warm["fx"] == {"fxgraph_cache_hit": cold["fx"]["fxgraph_cache_miss"], "fxgraph_cache_miss": 0}
    assert warm["saved"] == cold["saved"]  # what it loaded and used is saved again: the chain goes on
    assert warm["results"] == cold["results"]  # the loaded graphs compute exactly what the compiled ones did


@pytest.mark.parametrize(
    "content", [b"", b"not torch's format", b"\x00" * 64], ids=["empty", "text", "zeros"]
)
def test_a_corrupt_artifacts_file_only_warns(tmp_path, caplog, content):
    path = tmp_path / "artifacts.bin"
    path.write_bytes(content)
    with caplog.at_level(logging.INFO):
        assert load_compile_artifacts(str(path)) is None
    assert [(r.name, r.levelno) for r in caplog.records] == [("hf_switchback.compile_cache", logging.WARNING)]
    assert "not loaded" in caplog.text and str(path) in caplog.text
    assert logging.getLogger("torch.compiler._cache").level == logging.NOTSET  # torch's logger as it was


def test_a_missing_file_is_a_first_run(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        assert load_compile_artifacts(str(tmp_path / "none_yet.bin")) is None
    assert caplog.records == []


def test_saving_replaces_the_file_at_once_and_a_failed_write_only_warns(tmp_path, caplog, monkeypatch):
    from torch.compiler._cache import CacheInfo

    info = CacheInfo()
    info.artifacts["inductor"] += ["a", "b"]
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"new", info))
    path = tmp_path / "dir" / "artifacts.bin"
    path.parent.mkdir()
    path.write_bytes(b"old")
    assert save_compile_artifacts(str(path)) == {"inductor": 2}
    assert path.read_bytes() == b"new" and sorted(os.listdir(path.parent)) == ["artifacts.bin"]

    blocked = tmp_path / "a_file"
    blocked.write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        assert save_compile_artifacts(str(blocked / "artifacts.bin")) is None  # its folder is a file
    assert "could not write the compile artifacts" in caplog.text
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)  # nothing compiled yet
    assert save_compile_artifacts(str(path)) is None and path.read_bytes() == b"new"


def test_the_artifact_counts_of_torch_2_7_are_read_too(tmp_path, monkeypatch):
    @dataclasses.dataclass
    class CacheInfo27:  # torch 2.7's shape: one list per cache
        inductor_artifacts: list = dataclasses.field(default_factory=lambda: ["a", "b", "c"])
        autotune_artifacts: list = dataclasses.field(default_factory=list)
        aot_autograd_artifacts: list = dataclasses.field(default_factory=lambda: ["d"])

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"bytes", CacheInfo27()))
    assert save_compile_artifacts(str(tmp_path / "a.bin")) == {"inductor": 3, "aot_autograd": 1}
