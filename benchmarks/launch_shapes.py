"""The LayerNorm + quantize kernel's launch shapes: what each costs to compile and to run, side by side.

A graph of a cold compiled step waits for its slowest kernel compile, and the LayerNorm + quantize kernel
(kernels/norm_quant.py) at 1,024 columns was the slowest of the vision tower's forward (1.0-1.3 s in the
workers, against 0.3 s at 512 columns: BENCHMARKS.md, compile warm-up). Its compile time follows the values each
thread holds (rows per program x columns / threads), which its launch shape (rows per program, warps) sets, and
so does its speed. For each shape and each launch in --launches, in one process on a new Triton cache: the first
launch's seconds (Triton's compile of that specialization, plus one run) and the kernel's time (median of
triton's do_bench over the launches alternated, --rounds rounds).

    PYTHONPATH=src python benchmarks/launch_shapes.py --json $OUT/norm_launches.json [--without_add]
    PYTHONPATH=src python benchmarks/launch_shapes.py --device cpu --shapes 4x64   # smoke test
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import torch

# (tokens, width) of the LayerNorms of ViT-B/16 b256 (and SigLIP B/16), ViT-L/14 b128 and ViT-H/14 b64 / b192
SHAPES = [(50432, 768), (32896, 1024), (14784, 1024), (16448, 1280), (49344, 1280)]
LAUNCHES = ["2x1", "1x1", "1x2", "2x2", "1x4", "2x4", "4x4", "1x8", "2x8", "4x8"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=[f"{m}x{k}" for m, k in SHAPES], help="TOKENSxWIDTH")
    parser.add_argument("--launches", nargs="+", default=LAUNCHES, help="ROWSxWARPS per program")
    parser.add_argument("--qdtypes", nargs="+", default=["int8", "float8_e4m3fn"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--without_add", action="store_true", help="LayerNorm 1: no residual add before it")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: Triton's interpreter (smoke test)"
    )
    return parser.parse_args(argv)


def _pairs(values: list[str]) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in value.split("x")) for value in values]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_us(run, device: str) -> float:
    """The kernel's time: triton's do_bench on a GPU (median of its repetitions), one call's wall time on the CPU."""
    if device == "cuda":
        import triton.testing

        return 1000 * triton.testing.do_bench(run, warmup=10, rep=50)
    start = time.perf_counter()
    run()
    return 1e6 * (time.perf_counter() - start)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    # a new Triton cache: each launch's first call compiles (set before Triton reads it); removed afterwards
    saved = {name: os.environ.get(name) for name in ("TRITON_CACHE_DIR", "TRITON_INTERPRET")}
    with tempfile.TemporaryDirectory(prefix="launch_shapes_") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            return sweep(args)
        finally:  # the caller's environment again (the launch shape patch is undone by sweep)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def sweep(args) -> list[dict]:
    device = args.device
    if device == "cpu":  # the kernel through Triton's interpreter: the script's logic, not its figures
        os.environ["TRITON_INTERPRET"] = "1"
    import triton

    from hf_switchback.kernels import norm_quant

    shape_of = {}

    def launch_shape(block):
        return shape_of["now"]

    original = norm_quant._launch_shape
    norm_quant._launch_shape = launch_shape  # this process only: every launch below takes shape_of["now"]
    try:
        # Triton's one-time start (its key, the backend) on a launch not measured, so no row pays it
        shape_of["now"] = (1, 16)
        small = torch.randn(4, 64, device=device)
        norm_quant.add_layernorm_quantize_rowwise(small, small, None, None, 1e-5, torch.int8, torch.bfloat16)
        _sync(device)
        rows = []
        for m, k in _pairs(args.shapes):
            x = torch.randn(m, k, device=device)  # the residual stream: float32 under autocast
            delta = torch.randn(m, k, device=device, dtype=torch.bfloat16)  # the attention / MLP output
            weight, bias = torch.rand(k, device=device) + 0.5, torch.randn(k, device=device)
            for qname in args.qdtypes:
                qdtype = getattr(torch, qname)

                if args.without_add:  # LayerNorm 1: x alone
                    run = functools.partial(
                        norm_quant.layernorm_quantize_rowwise, x, weight, bias, 1e-5, qdtype, torch.bfloat16
                    )
                else:  # the residual add + LayerNorm 2: h = x + delta written, then normalized
                    run = functools.partial(
                        norm_quant.add_layernorm_quantize_rowwise,
                        x,
                        delta,
                        weight,
                        bias,
                        1e-5,
                        qdtype,
                        torch.bfloat16,
                    )

                timed = {}
                for launch in _pairs(args.launches):
                    shape_of["now"] = launch
                    _sync(device)
                    start = time.perf_counter()
                    run()
                    _sync(device)
                    timed[launch] = dict(first_launch_s=round(time.perf_counter() - start, 3), us=[])
                for _ in range(args.rounds):
                    for launch in _pairs(args.launches):
                        shape_of["now"] = launch
                        timed[launch]["us"].append(_time_us(run, device))
                best = min(statistics.median(t["us"]) for t in timed.values())
                for (per_program, warps), t in timed.items():
                    us = statistics.median(t["us"])
                    values = per_program * triton.next_power_of_2(k) // (32 * warps)
                    row = dict(
                        tokens=m,
                        width=k,
                        qdtype=qname,
                        residual_add=not args.without_add,
                        rows=per_program,
                        warps=warps,
                        values_per_thread=values,
                        first_launch_s=t["first_launch_s"],
                        us=round(us, 1),
                        vs_best=round(us / best, 3),
                    )
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                if args.json:
                    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
                    with open(args.json, "w") as f:
                        json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, f)
        return rows
    finally:
        norm_quant._launch_shape = original


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
