"""kernels/ttir_cache.py: torch.compile's TTIR analysis of our Triton kernels, once per specialization.

CPU tests put a counting stand-in where torch's generate_ttir is and check what the cache keys on; the GPU test
compiles a SwitchBack layer with torch's real function behind the cache (the kernels' declared accesses off,
kernels/kernel_access.py, which would leave it nothing to generate) and checks the cached TTIR is the TTIR.
"""

import inspect

import pytest
import torch
from transformers import CLIPVisionConfig
from transformers.models.clip.modeling_clip import CLIPEncoderLayer

from hf_switchback import SwitchBackConfig, apply_switchback
from hf_switchback.kernels import kernel_access, ttir_cache

triton_kernel_wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
quantize = pytest.importorskip("hf_switchback.kernels.quantize")  # imports triton
tl = pytest.importorskip("triton.language")


class _Counting:
    """Stands in for torch's generate_ttir: records each call, returns a fresh result per call."""

    def __init__(self):
        self.calls = []

    def __call__(self, kernel, kwargs, tma_descriptor_metadata):
        self.calls.append((kernel, dict(kwargs)))
        return object(), list(kwargs)


@pytest.fixture
def counting(monkeypatch):
    ttir_cache.uninstall()
    stand_in = _Counting()
    monkeypatch.setattr(triton_kernel_wrap, "generate_ttir", stand_in)
    assert ttir_cache.install()
    yield stand_in
    ttir_cache.uninstall()


def _kwargs(x, m=4096, k=1280, block_m=1, q_dtype="int8"):
    return dict(
        x_ptr=x,
        q_ptr=torch.empty(0, dtype=torch.int8),
        M=m,
        K=k,
        stride_xm=k,
        BLOCK_M=block_m,
        ACT=None,
        Q_DTYPE=tl.dtype(q_dtype),  # a new object of an equal Triton dtype per call
    )


def _foreign_kernel():  # a kernel of another library: its module is not ours
    pass


def test_a_repeated_specialization_runs_torchs_function_once(counting):
    generate = triton_kernel_wrap.generate_ttir
    kernel = quantize._rowwise_kernel
    first = generate(kernel, _kwargs(torch.empty(4096, 1280, dtype=torch.bfloat16)), {})
    # the same dtypes and values, other tensors of the same alignment (sizes do not matter to torch's function)
    again = generate(kernel, _kwargs(torch.empty(7, dtype=torch.bfloat16)), {})
    assert len(counting.calls) == 1
    assert again[0] is first[0] and again[1] == first[1] and again[1] is not first[1]  # a list of its own
    assert ttir_cache.stats == {"hits": 1, "misses": 1, "passed_on": {}}  # the Triton dtype keyed too


def test_autotuners_of_a_kernel_share_its_key_with_their_first_config(counting):
    import triton

    def autotuner():  # a new object per call, as torch wraps a launch with num_warps
        return triton.autotune(configs=[triton.Config({"BLOCK_M": 2})], key=[])(quantize._rowwise_kernel)

    generate = triton_kernel_wrap.generate_ttir
    x = torch.empty(1, dtype=torch.bfloat16)
    kwargs = {name: v for name, v in _kwargs(x).items() if name != "BLOCK_M"}
    generate(autotuner(), kwargs, {})
    generate(autotuner(), kwargs, {})
    generate(quantize._rowwise_kernel, _kwargs(x, block_m=2), {})  # what torch's function traces for them
    assert len(counting.calls) == 1
    generate(quantize._rowwise_kernel, _kwargs(x, block_m=1), {})
    assert len(counting.calls) == 2


@pytest.mark.parametrize(
    "change",
    [
        dict(x=torch.empty(1, dtype=torch.float16)),  # a tensor's dtype
        dict(m=4097),  # an integer Triton specializes on (divisibility by 16)
        dict(block_m=2),  # a constexpr
        dict(q_dtype="fp8e4nv"),  # a Triton dtype constexpr
    ],
    ids=["dtype", "integer", "constexpr", "triton dtype"],
)
def test_what_the_ttir_depends_on_is_in_the_key(counting, change):
    generate = triton_kernel_wrap.generate_ttir
    kernel = quantize._rowwise_kernel
    base = dict(x=torch.empty(1, dtype=torch.bfloat16))
    generate(kernel, _kwargs(**base), {})
    generate(kernel, _kwargs(**{**base, **change}), {})
    assert len(counting.calls) == 2


def test_symbolic_sizes_share_a_key_as_torch_replaces_them(counting):
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    m1, m2 = (env.create_unbacked_symint() for _ in range(2))
    generate = triton_kernel_wrap.generate_ttir
    x = torch.empty(1, dtype=torch.bfloat16)
    generate(quantize._rowwise_kernel, _kwargs(x, m=m1), {})
    generate(quantize._rowwise_kernel, _kwargs(x, m=m2), {})
    assert len(counting.calls) == 1


@pytest.mark.parametrize("case", ["foreign kernel", "tma descriptors", "unknown argument"])
def test_other_calls_always_run_torchs_function(counting, case):
    generate = triton_kernel_wrap.generate_ttir
    x = torch.empty(1, dtype=torch.bfloat16)
    kernel, kwargs, tma = quantize._rowwise_kernel, _kwargs(x), {}
    if case == "foreign kernel":
        kernel = _foreign_kernel
    elif case == "tma descriptors":
        tma = {"x_ptr": ("stable", ([64, 64],))}
    else:
        kwargs["q_ptr"] = object()
    for _ in range(2):
        generate(kernel, kwargs, tma)
    assert len(counting.calls) == 2
    assert ttir_cache.call_key(kernel, kwargs, tma) is None
    why = {
        "foreign kernel": "another library's kernel",
        "tma descriptors": "TMA descriptors",
        "unknown argument": "argument of type builtins.object",
    }[case]
    assert ttir_cache.stats["passed_on"] == {why: 2}


def test_install_once_uninstall_restores_and_the_switch_turns_it_off(monkeypatch, counting):
    assert ttir_cache.install()  # a second install keeps one wrapper
    assert triton_kernel_wrap.generate_ttir.hf_switchback_original is counting
    ttir_cache.uninstall()
    assert triton_kernel_wrap.generate_ttir is counting
    monkeypatch.setenv("HF_SWITCHBACK_TTIR_CACHE", "0")
    assert not ttir_cache.install()
    assert triton_kernel_wrap.generate_ttir is counting


def test_a_function_of_another_signature_is_left_alone(monkeypatch):
    ttir_cache.uninstall()

    def generate_ttir(kernel, kwargs):  # a torch whose function reads other arguments
        return None

    monkeypatch.setattr(triton_kernel_wrap, "generate_ttir", generate_ttir)
    assert not ttir_cache.install()
    assert triton_kernel_wrap.generate_ttir is generate_ttir


def test_torchs_function_has_the_signature_the_cache_knows():
    # The torch this runs on: if its generate_ttir changes its arguments, install() leaves it alone and this
    # test says the cache no longer applies.
    ttir_cache.uninstall()
    parameters = list(inspect.signature(triton_kernel_wrap.generate_ttir).parameters)
    assert parameters[:3] == ["kernel", "kwargs", "tma_descriptor_metadata"]


def small_layer_and_input():
    """A SwitchBack CLIP encoder layer on the GPU, every linear 8-bit, and an input for it."""
    torch.manual_seed(0)
    config = CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_attention_heads=4)
    layer = apply_switchback(CLIPEncoderLayer(config), SwitchBackConfig(min_tokens=0)).cuda()
    return layer, torch.randn(4, 160, 256, device="cuda")


def compiled_step(layer, x) -> list[torch.Tensor]:
    """Output, input gradient and weight gradients of a freshly traced and lowered torch.compile(layer)."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    layer.zero_grad()
    inputs = x.clone().requires_grad_()
    # the backward graph compiles at .backward(): inside the patch too, or it is read from an earlier compile's cache
    with inductor_config.patch(force_disable_caches=True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = torch.compile(layer)(inputs, None)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
    return [out, inputs.grad, *(p.grad for p in layer.parameters())]


@pytest.mark.gpu
def test_gpu_the_cache_changes_nothing_compiled_and_the_cached_ttir_is_torchs(monkeypatch):
    layer, x = small_layer_and_input()
    ttir_cache.uninstall()
    kernel_access.uninstall()  # the declarations would answer before torch generates any TTIR
    monkeypatch.setenv("HF_SWITCHBACK_DECLARED_ACCESS", "0")
    monkeypatch.setenv("HF_SWITCHBACK_TTIR_CACHE", "0")  # the first trace of a process would install it
    without = compiled_step(layer, x)
    monkeypatch.delenv("HF_SWITCHBACK_TTIR_CACHE")
    assert ttir_cache.install()
    try:
        cached = compiled_step(layer, x)
        assert ttir_cache.stats["misses"] > 0 and ttir_cache.stats["hits"] > ttir_cache.stats["misses"]
        assert ttir_cache.stats["passed_on"] == {}  # every call on our kernels keyed
        original = triton_kernel_wrap.generate_ttir.hf_switchback_original
        for (kernel, arguments, _), (module, _names) in ttir_cache._results.items():
            assert str(module) == str(_regenerate(original, kernel, arguments))
    finally:
        ttir_cache.uninstall()
    for got, want in zip(cached, without, strict=True):
        assert torch.equal(got, want)


def _regenerate(original, kernel, arguments):
    """Run torch's function again from a cache key's arguments (tensors as empty ones of their dtype)."""
    kwargs = {}
    for name, key in arguments:
        if key[0] == "tensor":
            kwargs[name] = torch.empty(2, dtype=key[1])
        elif key[0] == "symbolic":
            kwargs[name] = 2
        elif key[0] == "float":  # keyed by its bits
            kwargs[name] = float.fromhex(key[1])
        elif key[0] == "triton dtype":  # keyed by its name
            kwargs[name] = tl.dtype(key[1])
        else:
            kwargs[name] = key[1]
    return original(kernel, kwargs, {})[0]


@pytest.mark.parametrize("cache_on", [True, False])
def test_the_benchmarks_count_what_reaches_torchs_function(monkeypatch, cache_on):
    from test_benchmarks import load_script

    common = load_script("common")
    ttir_cache.uninstall()
    stand_in = _Counting()
    monkeypatch.setattr(triton_kernel_wrap, "generate_ttir", stand_in)
    if not cache_on:
        monkeypatch.setenv("HF_SWITCHBACK_TTIR_CACHE", "0")
    x = torch.empty(1, dtype=torch.bfloat16)
    try:
        with common.ttir_generation() as record:
            for _ in range(3):
                triton_kernel_wrap.generate_ttir(quantize._rowwise_kernel, _kwargs(x), {})
            tma = {"x_ptr": ("stable", ([64, 64],))}  # a call the cache passes on to torch's function
            triton_kernel_wrap.generate_ttir(quantize._rowwise_kernel, _kwargs(x), tma)
        assert record["calls"] == len(stand_in.calls) == (2 if cache_on else 4) and record["s"] >= 0
        # the timer is gone afterwards, the cache (where on) stays in front of torch's function
        current = triton_kernel_wrap.generate_ttir
        assert (current.hf_switchback_original if cache_on else current) is stand_in
    finally:
        ttir_cache.uninstall()
