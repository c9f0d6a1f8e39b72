"""Which tile configs of the portable 8-bit GEMM win at the GEMM shapes of CLIP training steps.

Times every config of `kernels/matmul.py`'s autotuning list (int8, bf16 out, tensor-wise weight scale) at each
per-call shape of a ViT-B/16, L/14 and H/14 step: forward (bias) and grad-input (no bias) of q/k/v/out_proj
(d -> d), fc1 (d -> 4d) and fc2 (4d -> d), vision and text towers, at the batches of bench_train.py and of the
memory regime (bench_memory.py). Then the smallest config subsets that stay within --tolerance of every shape's
best: what Hopper's autotuner keeps (`_SM90_TILE_SHAPES`); fewer configs compile and tune faster.
`--write_table DIR` also writes the per-shape winners as the GPU's table of kernels/gemm_configs/ (sm90.json on
the H100): shapes it names launch their config with no autotuning at all.

    PYTHONPATH=src python benchmarks/bench_gemm_configs.py --json $OUT/gemm_configs.json --write_table $OUT
    # the table again from saved timings (no GPU):
    PYTHONPATH=src python benchmarks/bench_gemm_configs.py --from_json gemm_configs.json \
        --write_table src/hf_switchback/kernels/gemm_configs
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path

import torch

TEXT_TOKENS = 77
# what time_configs measures: int8 operands, bf16 output (the training step's, under bf16 autocast)
A_DTYPE, OUT_DTYPE = "int8", "bfloat16"
# vision width, text width, vision tokens (patches + class token at 224 px), per-GPU batches
MODELS = {
    "vit-b-16": (768, 512, 197, (256,)),
    "vit-l-14": (1024, 768, 257, (128, 384)),
    "vit-h-14": (1280, 1024, 257, (64, 192)),
}


def gemm_shapes(models: dict = MODELS) -> list[tuple[int, int, int, bool]]:
    """(M, N, K, bias) of every 8-bit GEMM call of the models' steps: forward with bias, grad-input without."""
    shapes = set()
    for vision_d, text_d, vision_tokens, batches in models.values():
        for batch in batches:
            for d, m in ((vision_d, batch * vision_tokens), (text_d, batch * TEXT_TOKENS)):
                for out_f, in_f in ((d, d), (4 * d, d), (d, 4 * d)):
                    shapes.add((m, out_f, in_f, True))  # forward: x (M, in) @ W (out, in).T
                    shapes.add((m, in_f, out_f, False))  # grad-input: g (M, out) @ W.T (in, out).T
    return sorted(shapes)


def worst_ratio(rows: list[dict], subset: tuple[int, ...]) -> float:
    """Over all shapes, the largest time of the subset's best config relative to the shape's best of all."""
    worst = 1.0
    for row in rows:
        times = [t for t in row["ms"] if t is not None]
        kept = [row["ms"][i] for i in subset if row["ms"][i] is not None]
        worst = max(worst, (min(kept) if kept else float("inf")) / min(times))
    return worst


def covering_subsets(rows: list[dict], max_size: int = 4) -> list[dict]:
    """For each size, the config subset whose worst_ratio is lowest (ties: the earlier configs)."""
    n_configs = len(rows[0]["ms"])
    best = []
    for size in range(1, min(max_size, n_configs) + 1):
        ratio, subset = min((worst_ratio(rows, s), s) for s in itertools.combinations(range(n_configs), size))
        best.append(dict(size=size, configs=list(subset), worst_ratio=round(ratio, 4)))
    return best


def tile_of(config: str) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of a triton.Config as str() writes it."""
    fields = dict(re.findall(r"(\w+): (\d+)", config))
    return tuple(int(fields[name]) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))


def tile_table(rows: list[dict], tiles: list[tuple]) -> list[dict]:
    """Entries of a kernels/gemm_configs table: for each (N, K, M bucket) timed, the tile whose worst ratio to
    the fastest config over that key's rows (every M of the bucket, with and without bias) is smallest."""
    from hf_switchback.kernels.gemm_configs import m_bucket

    groups: dict[tuple[int, int, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["n"], row["k"], m_bucket(row["m"])), []).append(row)
    entries = []
    for (n, k, bucket), group in sorted(groups.items()):
        ratio, index = min((worst_ratio(group, (i,)), i) for i in range(len(tiles)))
        entries.append(
            dict(
                a=A_DTYPE,
                out=OUT_DTYPE,
                n=n,
                k=k,
                m_bucket=bucket,
                tile=list(tiles[index]),
                worst_ratio=round(ratio, 4),
            )
        )
    return entries


def write_table(directory: str, payload: dict, source: str) -> Path:
    """The GPU's table file (sm<major><minor>.json) in `directory`, from a payload of main()'s --json."""
    from hf_switchback.kernels.gemm_configs import FORMAT

    tiles = [tile_of(c) for c in payload["configs"]]
    header = dict(
        format=FORMAT,
        capability=payload["capability"],
        device=payload["device"],
        torch=payload["torch"],
        source=source,
        tile=["BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"],
        layout="a (M, K) and b (N, K) contiguous",
    )
    # one line per entry: a table a person reads and diffs
    entries = ",\n  ".join(json.dumps(e) for e in tile_table(payload["rows"], tiles))
    path = Path(directory) / f"{payload['capability']}.json"
    path.write_text(json.dumps(header, indent=1)[:-2] + f',\n "entries": [\n  {entries}\n ]\n}}\n')
    return path


def time_configs(shape: tuple[int, int, int, bool], configs: list) -> list[float | None]:
    """ms of each config at one shape (None where it does not compile or run, e.g. too much shared memory)."""
    import triton
    from triton.testing import do_bench

    from hf_switchback.kernels import matmul

    m, n, k, has_bias = shape
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
    c = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    a_scale, b_scale = torch.rand(m, device="cuda") / 127, torch.tensor(0.01, device="cuda")
    bias = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    args = (a, b, c, a_scale, b_scale, bias if has_bias else c, m, n, k, triton.next_power_of_2(m))
    strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    flags = dict(B_SCALE_PER_ROW=False, HAS_BIAS=has_bias, IS_INT=True, UPCAST=False, EVEN_K=k % 128 == 0)
    times = []
    for config in configs:
        meta = config.kwargs
        grid = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        def launch(meta=meta, grid=grid, config=config):
            matmul._scaled_mm_kernel[grid](
                *args, *strides, **flags, **meta, num_warps=config.num_warps, num_stages=config.num_stages
            )

        try:
            times.append(do_bench(launch, warmup=10, rep=40))
        except Exception as err:  # a config that does not fit this GPU; the tuner skips it too
            print(f"config {config} at {shape}: {type(err).__name__}", file=sys.stderr)
            times.append(None)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--json", default=None, help="also write every shape's times and the subsets here")
    parser.add_argument("--max_subset", type=int, default=4, help="largest config subset to report")
    parser.add_argument(
        "--write_table", default=None, help="also write the GPU's kernels/gemm_configs table to this folder"
    )
    parser.add_argument(
        "--from_json",
        default=None,
        help="no timing: the table from an earlier --json file (needs --write_table)",
    )
    args = parser.parse_args()
    if args.from_json:
        if not args.write_table:
            parser.error("--from_json only rebuilds the table: pass --write_table DIR")
        payload = json.loads(Path(args.from_json).read_text())
        payload.setdefault("capability", "sm90")  # files written before the field existed: the H100's
        print(f"wrote {write_table(args.write_table, payload, Path(args.from_json).name)}")
        return
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU with triton (it times the Triton GEMM's configs)")
    from hf_switchback.kernels import matmul

    configs = matmul._configs()
    rows = []
    for shape in gemm_shapes({name: MODELS[name] for name in args.models}):
        times = time_configs(shape, configs)
        rows.append(dict(zip(("m", "n", "k", "bias"), shape, strict=True), ms=times))
        best = min(t for t in times if t is not None)
        ratios = " ".join(f"{t / best:6.3f}" if t is not None else f"{'-':>6}" for t in times)
        print(f"M={shape[0]:6} N={shape[1]:5} K={shape[2]:5} bias={shape[3]!s:5} {ratios}", flush=True)
    subsets = covering_subsets(rows, args.max_subset)
    for subset in subsets:
        print(f"{subset['size']} config(s) {subset['configs']}: worst {subset['worst_ratio']:.3f}x the best")
    major, minor = torch.cuda.get_device_capability()
    payload = dict(
        device=torch.cuda.get_device_name(),
        capability=f"sm{major}{minor}",
        torch=torch.__version__,
        configs=[str(c) for c in configs],
        rows=rows,
        subsets=subsets,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.write_table:
        print(f"wrote {write_table(args.write_table, payload, 'bench_gemm_configs.py')}")


if __name__ == "__main__":
    main()
