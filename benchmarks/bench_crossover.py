"""Token crossovers: from how many tokens a SwitchBack linear beats bf16 `nn.Linear`, per (K, N), on this GPU.

    PYTHONPATH=src python benchmarks/bench_crossover.py --write_table   # the table min_tokens=None reads here
    PYTHONPATH=src python benchmarks/bench_crossover.py --dims 1664 --out /tmp/crossover.json
    PYTHONPATH=src python benchmarks/bench_crossover.py --device cpu --tiny   # smoke test (CI)

Shapes: for every width d (--dims) the linear families of a CLIP / SigLIP encoder layer: d->d
(q/k/v/out_proj), d->4d (fc1), 4d->d (fc2). Token counts M (--tokens): powers of two and two real per-call
counts, 19,712 = 256 x 77 text tokens and 50,432 = 256 x 197 ViT-B/16 tokens. For each shape and M one
training step of the layer is timed: forward + backward with the input and weight gradients, float32
parameters under bf16 autocast (as train_clip.py's --mixed_precision bf16), a bf16 input. Variants: bf16
`nn.Linear`; SwitchBack int8 and fp8 with the library defaults (backend="auto", tensor-wise weight scale,
grad_precision="auto", default KernelOptions) except min_tokens=0, so the 8-bit path always runs. All
variants of one (shape, M) run in one process, interleaved (--repeats rounds, the order rotating each round),
each sample a loop of steps timed with CUDA events; the median sample counts.

crossover = the smallest grid M from which SwitchBack is at least --margin (default 1.02) times as fast as
bf16 at that M and at every larger grid M; null = it never is (the default config then keeps that shape 16-bit
at every M). One JSON (--out, rewritten after every shape; `complete` says whether all shapes ran) and a
printed table. --write_table writes the same JSON as sm<major><minor>.json into
hf_switchback/kernels/crossover/ (or the folder given): the table SwitchBackConfig(min_tokens=None) reads on
GPUs of this compute capability.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from hf_switchback import SwitchBackConfig, SwitchBackLinear
from hf_switchback.functional import grad_precision
from hf_switchback.kernels import crossover

DIMS = (512, 768, 1024, 1280)
# From 2,048 (8 images of 257 tokens): fewer tokens per call are no training batch, and every power of two costs
# one more autotuning run of the int8 GEMM per shape.
TOKENS = (2048, 4096, 8192, 16384, 19712, 32768, 50432, 65536, 131072)
PRECISIONS = ("int8", "fp8")
# --tiny: a CPU smoke run of the whole script in seconds
TINY_DIMS, TINY_TOKENS = (16, 32), (8, 16, 32)
# Each timed sample loops the step until it covers about this much time (small M is launch-bound: one step is
# too short to time alone).
SAMPLE_MS = 4.0
MAX_LOOP = 64


def shapes(dims: list[int]) -> list[tuple[int, int, str]]:
    """(K, N, family) of every linear family of encoder layers of widths `dims`, without repeats."""
    out: dict[tuple[int, int], str] = {}
    for d in dims:
        for k, n, family in ((d, d, "d->d"), (d, 4 * d, "d->4d"), (4 * d, d, "4d->d")):
            out.setdefault((k, n), family)
    return [(k, n, family) for (k, n), family in out.items()]


def crossover_of(tokens: list[int], speedups: list[float], margin: float) -> int | None:
    """Smallest M of the sorted grid from which every speed-up is >= margin (None: not even the largest M)."""
    found = None
    for m, speedup in zip(reversed(tokens), reversed(speedups), strict=True):
        if speedup < margin:
            break
        found = m
    return found


class Timer:
    """Milliseconds per call of `fn`, looped `loops` times: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn, loops: int) -> float:
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(loops):
                fn()
            return (time.perf_counter() - start) * 1e3 / loops
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(loops):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / loops


def build_layers(k: int, n: int, device: torch.device, precisions, backend: str) -> dict[str, nn.Module]:
    """bf16 reference and one SwitchBack layer per precision, float32 parameters (autocast does the bf16)."""
    base = nn.Linear(k, n, device=device)
    layers: dict[str, nn.Module] = {"bf16": base}
    for precision in precisions:
        twin = nn.Linear(k, n, device=device)
        twin.load_state_dict(base.state_dict())
        config = SwitchBackConfig(precision=precision, backend=backend, min_tokens=0)
        layers[precision] = SwitchBackLinear.from_linear(twin, config)
    return layers


def step_fn(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, device: torch.device):
    params = list(layer.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            # A new view per call: SwitchBack reuses the 8-bit form of an input it saw last (q/k/v share one),
            # which would skip this layer's input quantize from the second step on.
            out = layer(x.view_as(x))
        out.backward(grad)

    return step


def time_shape(
    layers: dict[str, nn.Module], k: int, n: int, m: int, repeats: int, device
) -> dict[str, float]:
    """Median ms of one training step of each layer at M = m tokens, the variants interleaved."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    steps = {name: step_fn(layer, x, grad, device) for name, layer in layers.items()}
    timer = Timer(device)
    for step in steps.values():  # compile / autotune, then warm
        step()
        step()
    first = timer(steps["bf16"], 1)
    loops = max(1, min(MAX_LOOP, round(SAMPLE_MS / max(first, 1e-3))))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(timer(steps[name], loops))
    return {name: statistics.median(values) for name, values in samples.items()}


def git_commit() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    return "unknown"


def header(args, device: torch.device, tokens: list[int]) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, capability = props.name, f"sm{props.major}{props.minor}"
    else:
        name, capability = "cpu", None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    grads = {p: grad_precision(SwitchBackConfig(precision=p), device) for p in args.precisions}
    return {
        "format": crossover.FORMAT,
        "complete": False,
        "device": name,
        "capability": capability,
        "torch": torch.__version__,
        "triton": triton_version,
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
        "command": "python " + " ".join(sys.argv),
        "margin": args.margin,
        "repeats": args.repeats,
        "tokens": tokens,
        "step": "forward + backward (input and weight gradients), float32 parameters under bf16 autocast",
        "switchback": {
            p: f"SwitchBackConfig(precision={p!r}, min_tokens=0), grad precision here: {grads[p]}"
            for p in args.precisions
        },
        "precisions": {p: {} for p in args.precisions},
    }


def print_table(result: dict) -> None:
    tokens = result["tokens"]
    for precision, entries in result["precisions"].items():
        print(f"\n{precision}: speed-up over bf16 nn.Linear (fwd+bwd), crossover at >= {result['margin']}x")
        print(f"{'K->N':>12} {'family':>6} | " + " ".join(f"{m:>7}" for m in tokens) + " | crossover")
        for entry in entries.values():
            ups = " ".join(f"{entry['speedup'].get(str(m), float('nan')):7.2f}" for m in tokens)
            shape, found = f"{entry['K']:>5}->{entry['N']:<5}", json.dumps(entry["crossover"])
            print(f"{shape} {entry['family']:>6} | {ups} | {found}")
    sys.stdout.flush()


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The docstring as written (it is the method), and each flag's default."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: only with --tiny")
    parser.add_argument(
        "--tiny", action="store_true", help="smoke mode: tiny shapes, 1 repeat, torch backend"
    )
    parser.add_argument("--dims", type=int, nargs="+", default=list(DIMS), help="encoder widths d")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts M")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timed samples per variant")
    parser.add_argument("--margin", type=float, default=1.02, help="speed-up SwitchBack must reach to count")
    parser.add_argument("--out", type=Path, help="JSON file, rewritten after every shape")
    parser.add_argument(
        "--write_table",
        type=Path,
        nargs="?",
        const=crossover.TABLE_DIR,
        help="write the JSON as sm<major><minor>.json into this folder (no value: the package's crossover "
        "tables, which SwitchBackConfig(min_tokens=None) reads on GPUs of this capability)",
    )
    parser.add_argument("--commit", default=git_commit(), help="recorded in the JSON (default: git's HEAD)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU; use --device cpu --tiny for a smoke run")
    if args.device == "cpu" and not args.tiny:
        parser.error("--device cpu times the torch reference kernels, meaningless at real sizes: add --tiny")
    if args.write_table is not None and (args.tiny or args.device != "cuda"):
        parser.error("--write_table records what min_tokens=None uses on a GPU: run it there, without --tiny")
    if args.tiny:
        args.dims, args.tokens, args.repeats = list(TINY_DIMS), list(TINY_TOKENS), 1
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    backend = "torch" if args.tiny else "auto"
    tokens = sorted(set(args.tokens))
    result = header(args, device, tokens)
    table_path = None
    if args.write_table is not None:
        major, minor = torch.cuda.get_device_capability(device)
        table_path = args.write_table / crossover.table_name((major, minor))
    started = time.perf_counter()
    todo = shapes(args.dims)
    print(
        f"{result['device']}, {len(todo)} shapes x {len(tokens)} token counts, {args.precisions}", flush=True
    )
    for i, (k, n, family) in enumerate(todo):
        layers = build_layers(k, n, device, args.precisions, backend)
        times = {m: time_shape(layers, k, n, m, args.repeats, device) for m in tokens}
        for precision in args.precisions:
            speedups = [times[m]["bf16"] / times[m][precision] for m in tokens]
            result["precisions"][precision][f"{k}x{n}"] = {
                "K": k,
                "N": n,
                "family": family,
                "crossover": crossover_of(tokens, speedups, args.margin),
                "bf16_ms": {str(m): round(times[m]["bf16"], 4) for m in tokens},
                "switchback_ms": {str(m): round(times[m][precision], 4) for m in tokens},
                "speedup": {str(m): round(s, 3) for m, s in zip(tokens, speedups, strict=True)},
            }
        del layers
        print(
            f"[{i + 1}/{len(todo)}] {k}->{n} done, {time.perf_counter() - started:.0f} s elapsed", flush=True
        )
        if args.out is not None:
            write_json(result, args.out)
    result["complete"] = True
    result["seconds"] = round(time.perf_counter() - started, 1)
    for path in (args.out, table_path):
        if path is not None:
            write_json(result, path)
            print(f"wrote {path}", flush=True)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
