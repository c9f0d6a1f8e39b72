"""Kernels and layers on one GPU: SwitchBack int8/fp8 vs bf16 nn.Linear (and torchao), three questions (--mode).

layer (default): fwd+bwd of a d->4d linear ("fc1"), 4d->d ("fc2") and transformers' CLIPMLP ("block"), at
  `tokens` rows of bf16 input; median of triton's do_bench. Columns: ms, x bf16 (over eager nn.Linear), saved MiB
  (storages autograd keeps for backward, parameters and input excluded). --gemm times the bare 8-bit GEMMs (ours
  portable / TMA, cuBLAS fp8) against cuBLAS bf16, --kernels the (tokens, 4d) row passes, --wgrad the
  weight-gradient GEMMs (cuBLAS bf16 against fp8 with per-feature, per-tensor and 1 x 128 tile scales).
crossover: per width d in --dims, a stack of encoder layers (transformers' CLIPEncoderLayer, MLP 4d: the unit in
  which the LayerNorms and the activation write the next linear's 8-bit input), one training step of bf16 vs SwitchBack
  (library defaults, min_tokens=0; float32 parameters under bf16 autocast) at each M of --tokens, eager and
  under torch.compile, interleaved, median of --repeats CUDA-event samples. Crossover = the smallest M from which
  SwitchBack is >= --margin at that and every larger M (null: never), eager and compiled; each linear of the
  layer gets the layer's. --write_table [DIR] writes the table that SwitchBackConfig(min_tokens=None) reads.
gemm_configs: every tile config of the portable int8 GEMM at each per-call shape of ViT-B/L/H steps; --write_table
  [DIR] writes the GPU's kernels/gemm_configs table (measured shapes launch their tile without autotuning).

    PYTHONPATH=src python benchmarks/bench_linear.py --dims 1280 --tokens 65536 --cases block --compile-cases --gemm
    PYTHONPATH=src python benchmarks/bench_linear.py --dims 1280 768 --tokens 49408 --cases --wgrad
    PYTHONPATH=src python benchmarks/bench_linear.py --mode crossover --write_table   # into the package
    PYTHONPATH=src python benchmarks/bench_linear.py --mode crossover --dims 1280 1024 --out F; ... --resume --out F
    PYTHONPATH=src python benchmarks/bench_linear.py --mode gemm_configs --json $OUT/gemm_configs.json
    PYTHONPATH=src python benchmarks/bench_linear.py --mode gemm_configs --from_json F --write_table DIR  # no GPU
    PYTHONPATH=src python benchmarks/bench_linear.py --device cpu --tiny [--mode crossover]   # smoke test
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import itertools
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from hf_switchback import KernelOptions, SwitchBackConfig, apply_switchback
from hf_switchback.functional import AUTO_MIN_TOKENS_CUDA, grad_precision
from hf_switchback.kernels import crossover, gemm_configs, ops
from hf_switchback.modules import SwitchBackLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_smoke_flags, check_device, do_bench, parser_of, versions, write_json

# ------------------------------------------------------------------------------------------------ layer mode
CASES = ("fc1", "fc2", "block")


def build_case(case: str, d: int) -> nn.Module:
    """bf16 reference module of a case; the block is transformers' CLIPMLP (GELU tanh)."""
    if case != "block":
        return nn.Sequential(nn.Linear(d, 4 * d) if case == "fc1" else nn.Linear(4 * d, d))
    from transformers import CLIPVisionConfig
    from transformers.models.clip.modeling_clip import CLIPMLP

    heads = 16 if d % 16 == 0 else 1
    return CLIPMLP(CLIPVisionConfig(hidden_size=d, intermediate_size=4 * d, num_attention_heads=heads))


def switchback(model: nn.Module, cfg: SwitchBackConfig) -> nn.Module:
    # The fixed 16,384-token floor, not the crossover table (which would pick 16-bit below each layer's
    # measured threshold): the rows time the 8-bit path from there.
    cfg = cfg.replace(min_tokens=AUTO_MIN_TOKENS_CUDA)
    if isinstance(model, nn.Sequential):
        model[0] = SwitchBackLinear.from_linear(model[0], cfg)
        return model
    return apply_switchback(model, cfg.replace(target_modules=["fc1", "fc2"]))


def torchao_variant(model: nn.Module, recipe: str) -> nn.Module:
    if recipe == "int8_mp":
        from torchao import quantize_
        from torchao.prototype.quantized_training import int8_mixed_precision_training

        quantize_(model, int8_mixed_precision_training())
        return model
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    return model


def variants(compiled: bool):
    """(name, make(model) -> model, compile?) of every row: bf16, each SwitchBack precision x weight scaling x
    memory_efficient, and with `compiled` the compiled rows and torchao's."""
    grid = itertools.product(("int8", "fp8"), ("tensor", "row"), (False, True))
    out = [("bf16 nn.Linear", lambda m: m, False)]
    for p, scaling, memeff in grid:
        cfg = SwitchBackConfig(precision=p, weight_scaling=scaling, memory_efficient=memeff)
        out.append((f"switchback {cfg.variant}", lambda m, cfg=cfg: switchback(m, cfg), False))
    if compiled:
        out.append(("bf16 nn.Linear + compile", lambda m: m, True))
        for precision in ("int8", "fp8"):
            cfg = SwitchBackConfig(precision=precision)
            out.append((f"switchback {cfg.variant} + compile", lambda m, cfg=cfg: switchback(m, cfg), True))
        for recipe in ("tensorwise", "rowwise_with_gw_hp", "int8_mp"):
            name = "torchao int8 mixed-precision" if recipe == "int8_mp" else f"torchao float8 {recipe}"
            out.append((f"{name} + compile", lambda m, r=recipe: torchao_variant(m, r), True))
    return out


def saved_activation_mib(model: nn.Module, x: torch.Tensor) -> float:
    """Unique storages autograd saves in one forward, excluding parameters and the input itself."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values()) / 2**20


def run_case(case: str, d: int, tokens: int, args) -> None:
    """Print one table row per variant of one case."""
    torch.manual_seed(0)
    ref = build_case(case, d).to(args.device, torch.bfloat16)
    bf = dict(device=args.device, dtype=torch.bfloat16)
    x = torch.randn(tokens, 4 * d if case == "fc2" else d, **bf, requires_grad=True)
    grad, base_ms = torch.randn(tokens, 4 * d if case == "fc1" else d, **bf), None
    for name, make, compiled in variants(case in args.compile_cases):
        if args.only and name != "bf16 nn.Linear" and not any(o in name for o in args.only):
            continue
        ms = saved = None
        note = ""
        try:
            model = make(copy.deepcopy(ref))
            run_model = torch.compile(model) if compiled else model
            params = list(model.parameters())

            def step(run_model=run_model, params=params) -> None:
                for p in (*params, x):
                    p.grad = None
                run_model(x).backward(grad)

            ms, saved = do_bench(step, warmup=25, rep=100), saved_activation_mib(run_model, x)
        except Exception as err:  # a peer that fails must not end the run; the table says why
            note = f"{type(err).__name__}: {str(err).splitlines()[0][:90]}"
        base_ms = base_ms or ms
        ratio = base_ms / ms if ms and base_ms else None
        values = zip((ms, ratio, saved), (".3f", ".2f", ".0f"), strict=True)
        cells = [
            f"{case} d={d} tokens={tokens}",
            name,
            *("" if v is None else format(v, f) for v, f in values),
        ]
        print("| " + " | ".join([*cells, note]) + " |", flush=True)
        torch._dynamo.reset()


def bench_gemms(d: int, tokens: int) -> None:
    """Bare GEMMs of a block (operands already quantized): ours portable and TMA, fp8 on cuBLAS, vs cuBLAS bf16."""
    for name, n, k in (("d->4d", 4 * d, d), ("4d->d", d, 4 * d)):
        bf = dict(device="cuda", dtype=torch.bfloat16)
        a16, w16, bias = torch.randn(tokens, k, **bf), torch.randn(n, k, **bf), torch.randn(n, **bf)
        base = do_bench(lambda a16=a16, w16=w16, bias=bias: nn.functional.linear(a16, w16, bias))
        cells = [f"cuBLAS bf16 {base:.3f} ms"]
        for qdtype in (torch.int8, torch.float8_e4m3fn):
            (a_q, a_s), (w_q, w_s) = ops.quantize_rowwise(a16, qdtype), ops.quantize_tensorwise(w16, qdtype)
            paths = [("portable", False, "triton"), ("tma", True, "triton"), ("cublas", False, "cublas")]
            for tag, tma, fp8_gemm in paths[: 2 if qdtype == torch.int8 else 3]:
                options = KernelOptions(use_tma=tma, fp8_gemm=fp8_gemm)
                operands = (a_q, w_q, a_s, w_s, bias, torch.bfloat16)
                ms = do_bench(lambda a=operands, o=options: ops.scaled_matmul(*a, options=o))
                cells.append(f"{str(qdtype).split('.')[-1]} {tag} {ms:.3f} ms ({base / ms:.2f}x)")
        print(f"| gemm {name} d={d} M={tokens} | " + " | ".join(cells) + " |", flush=True)


def _tile_scaled(x_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, M) -> e4m3 q (R, M) and float32 scales (R, M / 128) stored column-major: one per 1 x 128 tile."""
    r, m = x_t.shape
    tiles = x_t.float().reshape(r, m // 128, 128)
    scale = (tiles.abs().amax(-1) / 448.0).clamp_min(2**-120)
    q = (tiles / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(r, m)
    return q, scale.t().contiguous().t()


def _wgrad_timings(m: int, n: int, k: int) -> dict:
    """ms of dW (n, k) = Gᵀ X over m tokens per GEMM and operand pass (see bench_wgrad_gemms)."""
    from torch.nn.functional import ScalingType, scaled_mm

    bf = dict(device="cuda", dtype=torch.bfloat16)
    one = torch.ones((), device="cuda")
    g, x = torch.randn(m, n, **bf), torch.randn(m, k, **bf)
    g_q, g_s = ops.quantize_over_tokens(g, torch.float8_e5m2)
    x_q, x_s = ops.quantize_over_tokens(x, torch.float8_e4m3fn)
    (gt_q, gt_s), (xt_q, xt_s) = _tile_scaled(g.t().contiguous()), _tile_scaled(x.t().contiguous())
    bf16 = dict(out_dtype=torch.bfloat16)
    runs = {
        "cuBLAS bf16": lambda: g.t() @ x,
        "fp8 per feature": lambda: torch._scaled_mm(g_q, x_q.t(), g_s[:, None], x_s[None, :], **bf16),
        "fp8 per tensor": lambda: torch._scaled_mm(g_q, x_q.t(), one, one, **bf16),
        "fp8 per tensor, fast accum": lambda: torch._scaled_mm(
            g_q, x_q.t(), one, one, **bf16, use_fast_accum=True
        ),
        "e4m3 1x128 tiles": lambda: scaled_mm(
            gt_q, xt_q.t(), gt_s, ScalingType.BlockWise1x128, xt_s, ScalingType.BlockWise1x128
        ),
        "G operand pass (e5m2)": lambda: ops.quantize_over_tokens(g, torch.float8_e5m2, 16),
        "X operand pass (e4m3)": lambda: ops.quantize_over_tokens(x, torch.float8_e4m3fn, 16),
    }
    return {label: do_bench(fn) for label, fn in runs.items()}


def bench_wgrad_gemms(d: int, tokens: int) -> None:
    """The weight-gradient GEMMs of a layer, dW = Gᵀ X over `tokens` (rounded down to whole 128-token tiles):
    cuBLAS bf16 against cuBLAS fp8 with per-feature scales (what wgrad_precision="fp8" runs), one scale per
    tensor (fast accumulation off / on) and 1 x 128 token tiles (DeepSeek-V3's scaling, e4m3 only), plus the
    per-feature operand passes wgrad_precision="fp8" adds."""
    m = tokens - tokens % 128
    for name, n, k in (("d x d", d, d), ("4d x d", 4 * d, d), ("d x 4d", d, 4 * d)):
        ms = _wgrad_timings(m, n, k)
        base = ms["cuBLAS bf16"]
        cells = [
            f"{label} {t:.3f} ms" + ("" if "pass" in label else f" ({base / t:.2f}x)")
            for label, t in ms.items()
        ]
        print(f"| wgrad {name} d={d} M={m} | " + " | ".join(cells) + " |", flush=True)


def bench_row_kernels(d: int, tokens: int) -> None:
    """The (tokens, 4d) passes of a block, each alone: the fused kernels vs the torch ops they replace."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    h, g = torch.randn(tokens, 4 * d, **bf), torch.randn(tokens, 4 * d, **bf)
    timings = {
        "torch gelu fwd": lambda: nn.functional.gelu(h, approximate="tanh"),
        "torch gelu bwd": lambda: torch.ops.aten.gelu_backward(g, h, approximate="tanh"),
        "quantize_rowwise": lambda: ops.quantize_rowwise(h, torch.int8),
        "act_quantize_rowwise": lambda: ops.act_quantize_rowwise(h, torch.int8, "gelu_tanh"),
    }
    for impl in ("tiles", "rows"):
        o = KernelOptions(act_backward_impl=impl)
        bwd = lambda o=o: ops.act_backward_quantize_colsum(g, h, torch.int8, "gelu_tanh", True, options=o)  # noqa: E731
        timings[f"act_backward_quantize_colsum ({impl})"] = bwd
    for width in (d, 4 * d):  # the output-gradient quantize + column sum (d: q/k/v/out_proj, fc2; 4d: fc1)
        grad = torch.randn(tokens, width, **bf)
        for qdtype in (torch.int8, torch.float8_e4m3fn):
            quantize = lambda g=grad, q=qdtype: ops.quantize_rowwise_colsum(g, q)  # noqa: E731
            timings[f"quantize_rowwise_colsum {str(qdtype).split('.')[-1]} (tokens, {width})"] = quantize
        # wgrad_precision="fp8": the output gradient's per-feature e5m2 operand, transposed and padded
        over_tokens = lambda g=grad: ops.quantize_over_tokens(g, torch.float8_e5m2, 16)  # noqa: E731
        timings[f"quantize_over_tokens e5m2 (tokens, {width})"] = over_tokens
    cells = [f"{name} {do_bench(fn, rep=50):.3f} ms" for name, fn in timings.items()]
    print(f"| row kernels ({tokens}, {4 * d}) bf16 | " + " | ".join(cells) + " |", flush=True)


def layer_mode(args) -> None:
    print(" | ".join(f"{k} {v}" for k, v in versions(args.device).items()))
    print("| case | variant | ms | x bf16 | saved MiB | note |\n|---|---|---:|---:|---:|---|")
    for d, tokens in itertools.product(args.dims, args.tokens):
        for case in args.cases:
            run_case(case, d, tokens, args)
        if args.kernels:
            bench_row_kernels(d, tokens)
        if args.gemm:
            bench_gemms(d, tokens)
        if args.wgrad:
            bench_wgrad_gemms(d, tokens)


# -------------------------------------------------------------------------------------------- crossover mode
DIMS = [512, 768, 1024, 1280]
# 16 to 256 sequences of 256 tokens (below 4,096 no layer paid in any measurement; each M is a compile per
# variant); 12,288 lies below the text towers of batch 192-256 (14,784-19,712 tokens)
TOKENS = [4096, 8192, 12288, 16384, 32768, 65536]
SEQUENCE = 256  # tokens per sequence of the measured layers' input
# A sample loops the step to about this long, at least MIN_LOOP times: with one step per sample the host never
# runs ahead of the GPU and every launch cost lands in the sample (a first H200 run with 4 ms samples measured
# SwitchBack layers 5-10% slower than the same layers inside a model's step).
SAMPLE_MS, MIN_LOOP, MAX_LOOP = 50.0, 3, 64
# Layers per measured stack, each compiled on its own as in a model (one graph, reused by the others): the step's
# fixed costs (autograd's start, zero_grad) spread over several layers as over a tower's.
STACK = 4


def layer_shapes(d: int) -> list[tuple[int, int, str]]:
    """(K, N, family) of the linears of an encoder layer of width d (MLP 4d): q/k/v/out_proj, fc1, fc2."""
    return [(d, d, "d->d"), (d, 4 * d, "d->4d"), (4 * d, d, "4d->d")]


class EncoderStack(nn.Module):
    """STACK transformers CLIPEncoderLayers of width d (MLP 4d, heads of 64, erf GELU, SDPA), float32
    parameters: the layers of one tower, which a model runs one after another."""

    def __init__(self, d: int, layers: int = STACK):
        super().__init__()
        from transformers import CLIPVisionConfig
        from transformers.models.clip.modeling_clip import CLIPEncoderLayer

        config = CLIPVisionConfig(
            hidden_size=d, intermediate_size=4 * d, num_attention_heads=max(1, d // 64), hidden_act="gelu"
        )
        config._attn_implementation = "sdpa"
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, None)
        return x


def crossover_of(tokens: list[int], speedups: list[float], margin: float) -> int | None:
    """Smallest M of the sorted grid from which every speed-up is >= margin (None: not even the largest M)."""
    found = None
    for m, speedup in zip(reversed(tokens), reversed(speedups), strict=True):
        if speedup < margin:
            break
        found = m
    return found


def sample_ms(fn, loops: int, device: torch.device) -> float:
    """Milliseconds per call of `fn` looped `loops` times: CUDA events on a GPU, the wall clock on a CPU."""
    if device.type != "cuda":
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


def time_stacks(stacks: dict[str, nn.Module], d: int, m: int, repeats: int, device) -> dict:
    """Median ms of one training step (forward, backward) of each stack at M = m tokens, interleaved."""
    sequence = min(SEQUENCE, m)
    x = torch.randn(m // sequence, sequence, d, device=device, requires_grad=True)
    grad = torch.randn_like(x)

    def step_of(stack):
        def step() -> None:
            stack.zero_grad(set_to_none=True)
            x.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16):
                # a new view per call: an eager SwitchBack linear reuses the 8-bit form of the input it saw last
                out = stack(x.view_as(x))
            out.backward(grad)

        return step

    steps = {name: step_of(stack) for name, stack in stacks.items()}
    for step in steps.values():  # compile / autotune, then warm
        step()
        step()
    one = max(sample_ms(steps["bf16+compile"], 1, device), 1e-3)
    loops = max(MIN_LOOP, min(MAX_LOOP, round(SAMPLE_MS / one)))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):  # the order rotates each round
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(sample_ms(steps[name], loops, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def crossover_stacks(d: int, precisions, backend: str, compile_backend: str, device) -> dict[str, nn.Module]:
    """bf16 and each SwitchBack precision (library defaults, min_tokens=0) of one stack of width d, each eager
    and with each layer under torch.compile (one static graph per M, as train_clip.py's per-block compile)."""
    base = EncoderStack(d).to(device)
    stacks: dict[str, nn.Module] = {"bf16": base}
    for precision in precisions:
        config = SwitchBackConfig(precision=precision, backend=backend, min_tokens=0)
        stacks[precision] = apply_switchback(copy.deepcopy(base), config)
    for name in list(stacks):
        compiled = stacks[f"{name}+compile"] = copy.deepcopy(stacks[name])
        for layer in compiled.layers:
            layer.compile(dynamic=False, backend=compile_backend)
    return stacks


def resumed(path: Path | None, result: dict) -> dict:
    """result with the layers an earlier run of the same grid wrote to `path` (--resume), else result as is."""
    if path is None or not path.exists():
        return result
    earlier = json.loads(path.read_text())
    same = ("tokens", "margin", "repeats", "unit", "step")
    if any(earlier.get(key) != result[key] for key in same) or set(earlier["precisions"]) != set(
        result["precisions"]
    ):
        raise SystemExit(
            f"--resume: {path} measured another grid ({', '.join(same)}, precisions); use a new --out"
        )
    result["precisions"] = earlier["precisions"]
    return result


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True
        )
    except OSError:
        return "unknown"
    return out.stdout.decode().strip() or "unknown"


def crossover_mode(args) -> dict:
    device, tokens, cuda = torch.device(args.device), sorted(set(args.tokens)), args.device == "cuda"
    props = torch.cuda.get_device_properties(device) if cuda else None
    grads = {p: grad_precision(SwitchBackConfig(precision=p), device) for p in args.precisions}
    result = dict(
        format=crossover.FORMAT, complete=False, device=props.name if cuda else "cpu",
        capability=f"sm{props.major}{props.minor}" if cuda else None, torch=torch.__version__,
        triton=versions(args.device, ("triton",))["triton"], date=datetime.date.today().isoformat(),
        commit=args.commit, command="python " + " ".join(sys.argv), margin=args.margin, repeats=args.repeats,
        tokens=tokens, unit=f"{STACK} encoder layers",
        step=f"forward + backward of {STACK} CLIP encoder layers (width d, MLP 4d, sequences of {SEQUENCE} tokens), "
        "float32 parameters under bf16 autocast; `crossover` eager, `crossover_compiled` with each layer compiled",
        switchback={p: f"SwitchBackConfig(precision={p!r}, min_tokens=0), grad precision here: {grads[p]}" for p in grads},
        precisions={p: {} for p in args.precisions},
    )  # fmt: skip
    table_path = args.write_table and args.write_table / crossover.table_name((props.major, props.minor))
    if args.resume:
        result = resumed(args.out, result)
    done = {entry["layer"] for entries in result["precisions"].values() for entry in entries.values()}
    started = time.perf_counter()
    print(f"{result['device']}, layers of widths {args.dims} x {len(tokens)} token counts, {args.precisions}")
    backend, compile_backend = ("torch", "eager") if args.tiny else ("auto", "inductor")
    # every M is its own static graph per layer forward: bf16's, and one shared by the SwitchBack precisions
    graphs = (1 + len(args.precisions)) * len(tokens)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, graphs)
    for i, d in enumerate(args.dims):
        if d in done:
            print(f"[{i + 1}/{len(args.dims)}] d={d}: measured in {args.out}", flush=True)
            continue
        stacks = crossover_stacks(d, args.precisions, backend, compile_backend, device)
        times = {m: time_stacks(stacks, d, m, args.repeats, device) for m in tokens}
        for precision in args.precisions:
            entry = dict(layer=d)
            for key, suffix in (("", ""), ("_compiled", "+compile")):
                speedups = [times[m][f"bf16{suffix}"] / times[m][f"{precision}{suffix}"] for m in tokens]
                entry[f"crossover{key}"] = crossover_of(tokens, speedups, args.margin)
                entry[f"bf16{key}_ms"] = {str(m): round(times[m][f"bf16{suffix}"], 4) for m in tokens}
                entry[f"switchback{key}_ms"] = {
                    str(m): round(times[m][f"{precision}{suffix}"], 4) for m in tokens
                }
                entry[f"speedup{key}"] = {str(m): round(s, 3) for m, s in zip(tokens, speedups, strict=True)}
            for k, n, family in layer_shapes(d):  # the layer's crossover for each of its linears
                result["precisions"][precision][f"{k}x{n}"] = dict(K=k, N=n, family=family, **entry)
        found = {
            p: tuple(result["precisions"][p][f"{d}x{d}"][f"crossover{key}"] for key in ("", "_compiled"))
            for p in args.precisions
        }
        elapsed = time.perf_counter() - started
        print(
            f"[{i + 1}/{len(args.dims)}] d={d}: crossover (eager, compiled) {found}, {elapsed:.0f} s",
            flush=True,
        )
        if args.out is not None:
            write_json(args.out, result, indent=1)
        del stacks
        torch._dynamo.reset()
    result.update(complete=True, seconds=round(time.perf_counter() - started, 1))
    for path in (args.out, table_path):
        if path is not None:
            write_json(path, result, indent=1)
            print(f"wrote {path}", flush=True)
    return result


# ----------------------------------------------------------------------------------------- gemm_configs mode
TEXT_TOKENS = 77
# what time_configs measures: the training step's operands and output, under bf16 autocast
A_DTYPE, OUT_DTYPE = "int8", "bfloat16"
# vision width, text width, vision tokens (224 px), per-GPU batches (bench_train.py's and bench_memory.py's)
MODELS = {"vit-b-16": (768, 512, 197, (256,)), "vit-l-14": (1024, 768, 257, (128, 384)), "vit-h-14": (1280, 1024, 257, (64, 192))}  # fmt: skip
TILE_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def gemm_shapes(models: dict = MODELS) -> list[tuple[int, int, int, bool]]:
    """(M, N, K, bias) of every 8-bit GEMM call of the models' steps: forward with bias, grad-input without."""
    found = set()
    for vision_d, text_d, vision_tokens, batches in models.values():
        for batch, (d, m) in itertools.product(batches, ((vision_d, vision_tokens), (text_d, TEXT_TOKENS))):
            for out_f, in_f in ((d, d), (4 * d, d), (d, 4 * d)):
                found |= {(batch * m, out_f, in_f, True), (batch * m, in_f, out_f, False)}
    return sorted(found)


def worst_ratio(rows: list[dict], subset: tuple[int, ...]) -> float:
    """Over all shapes, the largest time of the subset's best config relative to the shape's best of all."""
    worst = 1.0
    for row in rows:
        kept = [row["ms"][i] for i in subset if row["ms"][i] is not None]
        worst = max(worst, (min(kept) if kept else float("inf")) / min(t for t in row["ms"] if t is not None))
    return worst


def tile_of(config: str) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of a triton.Config as str() writes it."""
    fields = dict(re.findall(r"(\w+): (\d+)", config))
    return tuple(int(fields[name]) for name in TILE_FIELDS)


def tile_table(rows: list[dict], tiles: list[tuple]) -> list[dict]:
    """Table entries: per (N, K, M bucket) timed, the tile whose worst ratio to the fastest config over that
    key's rows (every M of the bucket, with and without bias) is smallest."""
    groups: dict[tuple[int, int, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["n"], row["k"], gemm_configs.m_bucket(row["m"])), []).append(row)
    entries = []
    for (n, k, bucket), group in sorted(groups.items()):
        ratio, index = min((worst_ratio(group, (i,)), i) for i in range(len(tiles)))
        entry = dict(a=A_DTYPE, out=OUT_DTYPE, n=n, k=k, m_bucket=bucket, tile=list(tiles[index]))
        entries.append(dict(entry, worst_ratio=round(ratio, 4)))
    return entries


def write_tile_table(directory: Path, payload: dict, source: str) -> Path:
    """The GPU's table file (sm<major><minor>.json) in `directory`, from a --json payload."""
    header = dict(format=gemm_configs.FORMAT, capability=payload["capability"], device=payload["device"])
    header.update(torch=payload["torch"], source=source, tile=list(TILE_FIELDS))
    header["layout"] = "a (M, K) and b (N, K) contiguous"
    tiles = [tile_of(c) for c in payload["configs"]]
    entries = ",\n  ".join(json.dumps(e) for e in tile_table(payload["rows"], tiles))  # one line per entry
    path = Path(directory) / f"{payload['capability']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(header, indent=1)[:-2] + f',\n "entries": [\n  {entries}\n ]\n}}\n')
    return path


def time_configs(shape: tuple[int, int, int, bool], configs: list) -> list[float | None]:
    """ms of each config at one shape (None where it does not compile or run, e.g. too much shared memory)."""
    import triton

    from hf_switchback.kernels import matmul

    m, n, k, has_bias = shape
    a, b = (torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda") for shape in ((m, k), (n, k)))
    c = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    a_scale, b_scale = torch.rand(m, device="cuda") / 127, torch.tensor(0.01, device="cuda")
    bias = torch.randn(n, dtype=torch.bfloat16, device="cuda") if has_bias else c
    args = (a, b, c, a_scale, b_scale, bias, m, n, k, triton.next_power_of_2(m))
    args += (*a.stride(), *b.stride(), *c.stride())
    flags = dict(B_SCALE_PER_ROW=False, HAS_BIAS=has_bias, IS_INT=True, UPCAST=False, EVEN_K=k % 128 == 0)
    times = []
    for config in configs:
        grid = (triton.cdiv(m, config.kwargs["BLOCK_M"]) * triton.cdiv(n, config.kwargs["BLOCK_N"]),)
        kwargs = dict(**flags, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
        launch = functools.partial(matmul._scaled_mm_kernel[grid], *args, **kwargs)
        try:
            times.append(do_bench(launch, warmup=10, rep=40))
        except Exception as err:  # a config that does not fit this GPU; the tuner skips it too
            print(f"config {config} at {shape}: {type(err).__name__}", file=sys.stderr)
            times.append(None)
    return times


def gemm_configs_mode(args) -> None:
    if args.from_json:
        payload = json.loads(Path(args.from_json).read_text())
        payload.setdefault("capability", "sm90")  # files written before the field existed: the H100's
        print(f"wrote {write_tile_table(args.write_table, payload, Path(args.from_json).name)}")
        return
    from hf_switchback.kernels import matmul

    configs, rows = matmul._configs(), []
    for shape in gemm_shapes({name: MODELS[name] for name in args.models}):
        times = time_configs(shape, configs)
        rows.append(dict(m=shape[0], n=shape[1], k=shape[2], bias=shape[3], ms=times))
        best = min(t for t in times if t is not None)
        ratios = " ".join(f"{t / best:6.3f}" if t is not None else f"{'-':>6}" for t in times)
        print(f"M={shape[0]:6} N={shape[1]:5} K={shape[2]:5} bias={shape[3]!s:5} {ratios}", flush=True)
    (major, minor), name = torch.cuda.get_device_capability(), torch.cuda.get_device_name()
    payload = dict(device=name, capability=f"sm{major}{minor}", torch=torch.__version__)
    payload.update(configs=[str(c) for c in configs], rows=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.write_table:
        print(f"wrote {write_tile_table(args.write_table, payload, 'bench_linear.py --mode gemm_configs')}")


# ------------------------------------------------------------------------------------------------------ main
def parse_args(argv=None) -> argparse.Namespace:
    parser = parser_of(__doc__)
    parser.add_argument("--mode", choices=("layer", "crossover", "gemm_configs"), default="layer")
    parser.add_argument("--dims", type=int, nargs="+", help="widths d (default: per mode)")
    parser.add_argument("--tokens", type=int, nargs="+", help="rows M (default: per mode)")
    parser.add_argument("--write_table", type=Path, nargs="?", const=True, metavar="DIR", help="see above")
    add_smoke_flags(parser)
    layer = parser.add_argument_group("layer mode").add_argument
    layer("--cases", nargs="*", default=list(CASES), choices=CASES, help="none: only --kernels / --gemm")
    layer("--compile-cases", nargs="*", default=["block"], choices=CASES, help="add compiled, torchao rows")
    layer("--only", nargs="*", help="only variants whose name contains one of these")
    layer("--gemm", action="store_true", help="also time the bare GEMMs of each d x tokens")
    layer("--kernels", action="store_true", help="also time the (tokens, 4d) row kernels one by one")
    layer("--wgrad", action="store_true", help="also time the weight-gradient GEMMs in bf16 and fp8 scalings")
    cross = parser.add_argument_group("crossover mode").add_argument
    cross("--precisions", nargs="+", default=["int8", "fp8"], choices=("int8", "fp8"))
    cross("--repeats", type=int, default=7, help="interleaved timed samples per variant")
    cross("--margin", type=float, default=1.02, help="speed-up SwitchBack must reach to count")
    cross("--out", type=Path, help="JSON file, rewritten after every layer width")
    cross(
        "--resume",
        action="store_true",
        help="keep the widths --out already holds (same grid), measure the rest",
    )
    cross("--commit", default=None, help="recorded in the JSON (default: git's HEAD)")
    tiles = parser.add_argument_group("gemm_configs mode").add_argument
    tiles("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    tiles("--json", default=None, help="every shape's times per config")
    tiles("--from_json", default=None, help="no timing: the table from an earlier --json file")
    args = parser.parse_args(argv)
    if args.write_table is True:
        args.write_table = (crossover if args.mode == "crossover" else gemm_configs).TABLE_DIR
    if args.from_json:
        if args.mode != "gemm_configs" or not args.write_table:
            parser.error("--from_json rebuilds a table: pass --mode gemm_configs --write_table DIR")
        return args
    if args.mode == "gemm_configs" and not torch.cuda.is_available():
        parser.error("--mode gemm_configs times the Triton GEMM's configs: it needs a CUDA GPU")
    check_device(parser, args)
    if (args.gemm or args.wgrad or args.kernels) and not torch.cuda.is_available():
        parser.error("--gemm, --kernels and --wgrad time CUDA kernels: they need a CUDA GPU")
    if args.resume and (args.mode != "crossover" or args.out is None):
        parser.error("--resume continues a crossover run: pass --mode crossover and the --out it wrote")
    if args.write_table and (args.tiny or args.mode == "layer"):
        parser.error("--write_table records a GPU's measurement: --mode crossover / gemm_configs, no --tiny")
    cross = args.mode == "crossover"
    args.dims = list(
        dict.fromkeys(args.dims or ([16, 32] if args.tiny else DIMS if cross else [768, 1024, 1280]))
    )
    args.tokens = args.tokens or ([8, 16, 32] if args.tiny else TOKENS if cross else [65536, 4096])
    if args.tiny:  # the layer rows on the torch reference path, in seconds
        args.repeats, args.compile_cases, args.gemm, args.kernels = 1, [], False, False
    args.commit = args.commit or git_commit()
    return args


def main(argv=None):
    args = parse_args(argv)
    modes = {"layer": layer_mode, "crossover": crossover_mode, "gemm_configs": gemm_configs_mode}
    return modes[args.mode](args)


if __name__ == "__main__":
    main()
