"""kernels/named_triton_kernels.py: torch's triton_op told which kernels our operators launch (no source parse).

The claim: inside `named`, a triton_op declaration records the given kernels and torch's own analysis is not
called; outside, torch's function is back. Where triton is installed: the list our operators get (every kernel
of our kernel modules) holds every kernel torch's own analysis finds in each operator's body (a superset keeps
AOT autograd's cache key sound; torch 2.13's analysis finds none in our bodies, which launch through helpers).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch._library.triton as triton_library

from hf_switchback.kernels import named_triton_kernels

HAS_ANALYSIS = hasattr(triton_library, "get_inner_triton_kernels")


def test_named_replaces_the_analysis_only_within_the_block(monkeypatch):
    sentinel = object()
    if not HAS_ANALYSIS:
        with named_triton_kernels.named([sentinel]):
            assert not hasattr(triton_library, "get_inner_triton_kernels")
        return
    calls = []
    original = triton_library.get_inner_triton_kernels
    monkeypatch.setattr(triton_library, "get_inner_triton_kernels", lambda fn: calls.append(fn) or [])
    patched = triton_library.get_inner_triton_kernels
    with named_triton_kernels.named([sentinel]):

        @torch.library.triton_op("hf_switchback_test::named_kernels_probe", mutates_args=())
        def probe(x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        assert triton_library.get_inner_triton_kernels is not patched
    assert triton_library.get_inner_triton_kernels is patched and original is not None
    assert calls == []  # torch's analysis never ran for the declaration inside the block
    assert triton_library.get_triton_kernels_for_op("hf_switchback_test::named_kernels_probe") == [sentinel]
    x = torch.randn(3)
    assert torch.equal(torch.ops.hf_switchback_test.named_kernels_probe(x), x)


def test_the_block_restores_torch_after_an_error():
    if not HAS_ANALYSIS:
        pytest.skip(
            "this torch has no source analysis to replace (nothing is patched; the test above checks it)"
        )
    original = triton_library.get_inner_triton_kernels
    with pytest.raises(ValueError), named_triton_kernels.named([]):
        raise ValueError
    assert triton_library.get_inner_triton_kernels is original


def test_our_operators_list_every_kernel_torch_finds():
    pytest.importorskip("triton")
    if not HAS_ANALYSIS:
        pytest.skip("this torch has no source analysis to compare with")
    ops = importlib.import_module("hf_switchback.kernels.ops")
    from hf_switchback.kernels import library

    ours = set(
        map(
            id,
            named_triton_kernels.of_modules(
                ops._matmul, ops._norm_quant, ops._quantize, ops._transpose_quantize
            ),
        )
    )
    traceable = [op for op in library.OPS if op.traceable and op.name in ops.CUDA]
    assert traceable and len(ours) >= 10  # the kernel modules' jit functions and autotuners
    for op in traceable:
        listed = triton_library.get_triton_kernels_for_op(op.qualname)
        assert set(map(id, listed)) == ours, op.name
        found = triton_library.get_inner_triton_kernels(ops.CUDA[op.name])
        assert set(map(id, found)) <= ours, (op.name, [getattr(k, "__name__", k) for k in found])
