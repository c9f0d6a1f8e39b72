"""The fused MLP's two activation passes under torch.compile: Inductor's code vs our Triton kernels.

    PYTHONPATH=src python benchmarks/bench_act_quantize.py                  # CLIP MLP shapes, H100
    PYTHONPATH=src python benchmarks/bench_act_quantize.py --device cpu --tiny   # smoke test (CI)

A compiled SwitchBack MLP (fuse_mlp, e.g. under memory_efficient) runs two passes over the (M, 4d) fc1 output
h besides its GEMMs: forward, act(h) quantized row-wise for fc2's GEMM; backward, grad_h = grad * act'(h)
with its row-wise 8-bit form and column sum (fc1's bias gradient), and act(h) for fc2's weight gradient.
kernels/compiled.py leaves them to Inductor (torch ops it can fuse) or sends them to our Triton kernels
(KernelOptions.triton_act_quantize). Each row times one pass at a real per-call shape, in one process:

  inductor   torch.compile of the torch reference (kernels/reference.py), what Inductor emits in a step
  triton     our kernel (kernels/quantize.py; backward: "rows" / "tiles" by KernelOptions.act_backward_impl)

Shapes: M tokens x 4d, for ViT-B/16 b256 (50,432 x 3072), ViT-L/14 b384 (98,688 x 4096) and ViT-H/14 b192
(49,344 x 5120). The time is the median of triton's do_bench; GB/s counts the bytes a pass must move at least.
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_switchback.kernels import reference

SHAPES = {"vit-b-16 b256": (50432, 3072), "vit-l-14 b384": (98688, 4096), "vit-h-14 b192": (49344, 5120)}
TINY_SHAPES = {"tiny": (64, 128)}


def _timer(device: str):
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, rep=50)

    import time

    def cpu_ms(fn) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return cpu_ms


def _passes(device: str):
    """name -> (forward fn(h), backward fn(grad, h, want_act)) for every implementation that runs here."""
    fwd_ref = torch.compile(reference.act_quantize_rowwise, dynamic=False)
    bwd_ref = torch.compile(reference.act_backward_quantize_colsum, dynamic=False)
    out = {
        "inductor": (
            lambda h, q: fwd_ref(h, q, "gelu"),
            lambda g, h, q, want: bwd_ref(g, h, q, "gelu", want),
        )
    }
    if device == "cuda":
        from hf_switchback.kernels import quantize

        for impl in ("rows", "tiles"):
            out[f"triton ({impl})"] = (
                lambda h, q: quantize.act_quantize_rowwise(h, q, "gelu"),
                lambda g, h, q, want, impl=impl: quantize.act_backward_quantize_colsum(
                    g, h, q, "gelu", want, impl=impl
                ),
            )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="one tiny shape (smoke test)")
    parser.add_argument("--qdtype", choices=("int8", "fp8"), default="int8")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --device cpu --tiny for the smoke test")
    qdtype = torch.int8 if args.qdtype == "int8" else torch.float8_e4m3fn
    timer, rows = _timer(args.device), []
    for shape_name, (m, k) in (TINY_SHAPES if args.tiny else SHAPES).items():
        gen = torch.Generator(args.device).manual_seed(0)
        h = torch.randn(m, k, device=args.device, dtype=torch.bfloat16, generator=gen)
        g = torch.randn(m, k, device=args.device, dtype=torch.bfloat16, generator=gen) * 1e-3
        elems = m * k
        for impl, (fwd, bwd) in _passes(args.device).items():
            for pass_name, fn, min_bytes in (
                ("forward", lambda fwd=fwd, h=h: fwd(h, qdtype), elems * 3),
                ("backward", lambda bwd=bwd, g=g, h=h: bwd(g, h, qdtype, False), elems * 7),
                ("backward + act", lambda bwd=bwd, g=g, h=h: bwd(g, h, qdtype, True), elems * 9),
            ):
                ms = timer(fn)
                row = {"shape": shape_name, "M": m, "K": k, "pass": pass_name, "impl": impl, "ms": ms}
                row["GB/s"] = min_bytes / ms / 1e6
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'shape':<15} {'pass':<15} {'impl':<16} {'ms':>8} {'GB/s':>8}")
    for r in rows:
        print(f"{r['shape']:<15} {r['pass']:<15} {r['impl']:<16} {r['ms']:8.3f} {r['GB/s']:8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": _device_name(args.device), "torch": torch.__version__, "rows": rows}, f, indent=1
            )
    return rows


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


if __name__ == "__main__":
    main()
