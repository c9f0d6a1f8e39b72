"""Layer benchmark: SwitchBack int8/fp8 vs bf16 nn.Linear and torchao, fwd+bwd, on one GPU, one table.

    PYTHONPATH=src python benchmarks/bench_linear.py                       # all cases (d 768/1024/1280)
    PYTHONPATH=src python benchmarks/bench_linear.py --dims 1280 --tokens 65536 --cases block
    PYTHONPATH=src python benchmarks/bench_linear.py --device cpu --tiny   # smoke test (CI): torch reference

Cases: a single linear d->4d ("fc1"), 4d->d ("fc2"), and the CLIP MLP block fc1 -> GELU -> fc2 ("block":
transformers' CLIPMLP, hidden_act from --act; SwitchBack rows run three separate ops, the default; --mlp-ab adds
"[fuse_mlp=True]" rows, marked "[fused mlp]" when the block really ran as one fused op; --tma-ab adds "[tma]"
rows on the Hopper TMA GEMM; each A/B row is the same layers with one KernelOptions field changed), at
`tokens` rows of bf16 input. Each variant runs forward + backward (input gradient included, as inside a
network); the time is the median of triton's do_bench (on the CPU, of a few wall-clock calls). Columns:
- ms, x bf16: time and speed-up over eager bf16 nn.Linear of the same case (> 1 is faster);
- saved MiB: bytes autograd keeps alive for backward (unique storages reached through saved-tensor hooks,
  parameters and the caller's input excluded: what a network pays per layer for activations);
- quant ms: time of the quantize kernels one fwd+bwd step of the case launches, timed on their own
  (SwitchBack variants on the GPU only).
torchao (float8 tensorwise / rowwise_with_gw_hp, int8 mixed-precision training) is optional: if it does not
import, its rows say why. Compiled variants use torch.compile on the whole case module.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hf_switchback import KernelOptions, SwitchBackConfig, apply_switchback
from hf_switchback.functional import AUTO_MIN_TOKENS_CUDA, quantized_dtypes
from hf_switchback.kernels import ops
from hf_switchback.mlp import is_fused_mlp
from hf_switchback.modules import SwitchBackLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import do_bench, versions

# --tiny: a CPU smoke run of the layer rows in seconds
TINY_DIMS, TINY_TOKENS = [16], [32]


@dataclass
class Row:
    case: str
    variant: str
    ms: float | None = None
    ratio: float | None = None
    saved_mib: float | None = None
    quant_ms: float | None = None
    note: str = ""


def build_case(case: str, d: int, hidden_act: str = "gelu_pytorch_tanh") -> nn.Module:
    """bf16 reference module of a case (the variants are made from deep copies of it).

    The block is transformers' CLIPMLP (fc1 -> activation_fn -> fc2), so apply_switchback fuses it unless
    the config says fuse_mlp=False."""
    if case == "fc1":
        return nn.Sequential(nn.Linear(d, 4 * d))
    if case == "fc2":
        return nn.Sequential(nn.Linear(4 * d, d))
    from transformers import CLIPVisionConfig
    from transformers.models.clip.modeling_clip import CLIPMLP

    heads = 16 if d % 16 == 0 else 1
    config = CLIPVisionConfig(
        hidden_size=d, intermediate_size=4 * d, hidden_act=hidden_act, num_attention_heads=heads
    )
    return CLIPMLP(config)


def switchback(model: nn.Module, cfg: SwitchBackConfig) -> nn.Module:
    if cfg.min_tokens is None:
        # The rows measure the 8-bit path above the 16,384-token floor; the default's per-shape table
        # (kernels/crossover) would keep these shapes 16-bit on Hopper.
        cfg = cfg.replace(min_tokens=AUTO_MIN_TOKENS_CUDA)
    if isinstance(model, nn.Sequential):
        for i, layer in enumerate(model):
            if isinstance(layer, nn.Linear):
                model[i] = SwitchBackLinear.from_linear(layer, cfg)
        return model
    return apply_switchback(model, cfg.replace(target_modules=["fc1", "fc2"]))


def first_config(model: nn.Module) -> SwitchBackConfig:
    return next(m.switchback_config for m in model.modules() if isinstance(m, SwitchBackLinear))


def torchao_variant(model: nn.Module, recipe: str) -> nn.Module:
    if recipe == "int8_mp":
        from torchao import quantize_
        from torchao.prototype.quantized_training import int8_mixed_precision_training

        quantize_(model, int8_mixed_precision_training())
        return model
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    return model


def step_fn(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        model(x).backward(grad)

    return step


def saved_activation_mib(model: nn.Module, x: torch.Tensor) -> float:
    """Unique storages autograd saves in one forward, excluding parameters and the input itself."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return sum(seen.values()) / 2**20


def weight_quantizers(cfg: SwitchBackConfig):
    """The weight's quantize and quantize-transposed ops of the config's weight scaling."""
    if cfg.weight_scaling == "tensor":
        return ops.quantize_tensorwise, ops.quantize_tensorwise_transposed
    return ops.quantize_rowwise, ops.quantize_rowwise_transposed


def quant_ms(case: str, d: int, tokens: int, cfg: SwitchBackConfig, fused_act: str | None = None) -> float:
    """The quantize kernels of one fwd+bwd of the case, each timed alone, summed.

    fused_act (a fused MLP block): its kernels instead, whose activation-fused passes also do the
    activation's forward and backward (the unfused rows run those as separate torch ops, not counted)."""
    qf, qg = quantized_dtypes(cfg, torch.device("cuda"))
    if fused_act is not None:
        return fused_quant_ms(d, tokens, cfg, fused_act)
    shapes = {"fc1": [(d, 4 * d)], "fc2": [(4 * d, d)], "block": [(d, 4 * d), (4 * d, d)]}[case]
    total = 0.0
    for k, n in shapes:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        wq, wtq = weight_quantizers(cfg)
        total += do_bench(lambda x=x: ops.quantize_rowwise(x, qf), rep=20)
        total += do_bench(lambda g=g: ops.quantize_rowwise(g, qg), rep=20)
        total += do_bench(lambda w=w, wq=wq: wq(w, qf), rep=20)
        total += do_bench(lambda w=w, wtq=wtq: wtq(w, qg), rep=20)
        if cfg.memory_efficient:
            xq, xs = ops.quantize_rowwise(x, qf)
            total += do_bench(lambda xq=xq, xs=xs: ops.dequantize_rowwise(xq, xs, torch.bfloat16), rep=20)
    return total


def fused_quant_ms(d: int, tokens: int, cfg: SwitchBackConfig, act: str) -> float:
    qf, qg = quantized_dtypes(cfg, torch.device("cuda"))
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, h = torch.randn(tokens, d, **bf), torch.randn(tokens, 4 * d, **bf)
    g, gh = torch.randn(tokens, d, **bf), torch.randn(tokens, 4 * d, **bf)
    w = torch.randn(4 * d, d, **bf)
    wq, wtq = weight_quantizers(cfg)
    total = do_bench(lambda: ops.quantize_rowwise(x, qf), rep=20)
    total += do_bench(lambda: ops.act_quantize_rowwise(h, qf, act), rep=20)
    total += do_bench(lambda: ops.quantize_rowwise_colsum(g, qg), rep=20)
    options = cfg.kernel_options
    total += do_bench(lambda: ops.act_backward_quantize_colsum(gh, h, qg, act, True, options=options), rep=20)
    total += 2 * do_bench(lambda: wq(w, qf), rep=20) + 2 * do_bench(lambda: wtq(w, qg), rep=20)
    if cfg.memory_efficient:
        xq, xs = ops.quantize_rowwise(x, qf)
        total += do_bench(lambda: ops.dequantize_rowwise(xq, xs, torch.bfloat16), rep=20)
    return total


# A/B rows: the same layers with one KernelOptions field changed (tag in the row name -> options).
UNFUSED = " [unfused bias grad]"
WITH_TMA = " [tma]"
UNFUSED_OPTIONS = KernelOptions(fused_bias_grad=False)
TMA_OPTIONS = KernelOptions(use_tma=True)
# The fused block's activation backward after fc2's grad-input GEMM: 2-D tiles, or whole rows per program.
ACT_BWD = {
    " [act-bwd tiles]": KernelOptions(act_backward_impl="tiles"),
    " [act-bwd rows]": KernelOptions(act_backward_impl="rows"),
}


def fuse_tag(cfg: SwitchBackConfig) -> str:
    """Name suffix of a variant whose CLIP MLP runs fused (fuse_mlp, by default on with memory_efficient)."""
    return " [fuse_mlp=True]" if cfg.fuses_mlp else ""


# hidden_act -> the fused kernels' activation name
_ACT_KIND = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "quick_gelu": "quick_gelu"}


def variants(
    include_compile: bool,
    tokens: int,
    bias_grad_ab: bool = False,
    mlp_ab: bool = False,
    tma_ab: bool = False,
    bwd_ab: bool = False,
) -> list[tuple[str, Callable[[nn.Module], nn.Module], bool]]:
    """(name, make(model) -> model, compile?)."""
    out: list[tuple[str, Callable[[nn.Module], nn.Module], bool]] = [("bf16 nn.Linear", lambda m: m, False)]
    for precision in ("int8", "fp8"):
        for scaling in ("tensor", "row"):
            for mem in (False, True):
                cfg = SwitchBackConfig(precision=precision, weight_scaling=scaling, memory_efficient=mem)
                out.append((f"switchback {cfg.variant}", lambda m, cfg=cfg: switchback(m, cfg), False))
    if bwd_ab:
        for precision in ("int8", "fp8"):
            for tag, options in ACT_BWD.items():
                cfg = SwitchBackConfig(precision=precision, fuse_mlp=True, kernel_options=options)
                tag = fuse_tag(cfg) + tag
                out.append((f"switchback {cfg.variant}{tag}", lambda m, cfg=cfg: switchback(m, cfg), False))
    if tma_ab:
        # The persistent TMA GEMM on Hopper (KernelOptions(use_tma=True); the portable kernel is the default).
        for precision in ("int8", "fp8"):
            for fuse, mem in ((False, False), (True, False), (False, True), (True, True)):
                cfg = SwitchBackConfig(
                    precision=precision, fuse_mlp=fuse, memory_efficient=mem, kernel_options=TMA_OPTIONS
                )
                tag = fuse_tag(cfg)
                out.append(
                    (f"switchback {cfg.variant}{tag}{WITH_TMA}", lambda m, cfg=cfg: switchback(m, cfg), False)
                )
    if mlp_ab:
        # The block as one fused SwitchBack MLP op (fuse_mlp=True; three separate ops are the default).
        for precision in ("int8", "fp8"):
            for scaling in ("tensor", "row"):
                for mem in (False, True):
                    cfg = SwitchBackConfig(
                        precision=precision, weight_scaling=scaling, memory_efficient=mem, fuse_mlp=True
                    )
                    name = f"switchback {cfg.variant}{fuse_tag(cfg)}"
                    out.append((name, lambda m, cfg=cfg: switchback(m, cfg), False))
    if bias_grad_ab:
        # Same layers with the bias gradient as a separate column-sum pass (KernelOptions(fused_bias_grad=False)).
        for precision, scaling in (("int8", "tensor"), ("int8", "row"), ("fp8", "row")):
            cfg = SwitchBackConfig(
                precision=precision, weight_scaling=scaling, kernel_options=UNFUSED_OPTIONS
            )
            out.append((f"switchback {cfg.variant}{UNFUSED}", lambda m, cfg=cfg: switchback(m, cfg), False))
    if include_compile:
        out.append(("bf16 nn.Linear + compile", lambda m: m, True))
    if tokens < AUTO_MIN_TOKENS_CUDA:
        # Below the floor backend="auto" runs bf16; these rows show what forcing the 8-bit kernels would cost.
        for precision in ("int8", "fp8"):
            cfg = SwitchBackConfig(precision=precision, backend="triton")
            out.append(
                (f"switchback {cfg.variant} backend=triton", lambda m, cfg=cfg: switchback(m, cfg), False)
            )
    if include_compile:
        for precision in ("int8", "fp8"):
            cfg = SwitchBackConfig(precision=precision)
            out.append((f"switchback {cfg.variant} + compile", lambda m, cfg=cfg: switchback(m, cfg), True))
        for recipe in ("tensorwise", "rowwise_with_gw_hp", "int8_mp"):
            name = "torchao int8 mixed-precision" if recipe == "int8_mp" else f"torchao float8 {recipe}"
            out.append((f"{name} + compile", lambda m, r=recipe: torchao_variant(m, r), True))
    return out


def run_case(
    case: str,
    d: int,
    tokens: int,
    compile_cases: set[str],
    only: list[str] | None = None,
    bias_grad_ab: bool = False,
    mlp_ab: bool = False,
    hidden_act: str = "gelu_pytorch_tanh",
    tma_ab: bool = False,
    bwd_ab: bool = False,
    exact: bool = False,
    device: str = "cuda",
) -> list[Row]:
    torch.manual_seed(0)
    ref = build_case(case, d, hidden_act).to(device, torch.bfloat16)
    k_in = 4 * d if case == "fc2" else d
    n_out = d if case == "fc2" else 4 * d if case == "fc1" else d
    x = torch.randn(tokens, k_in, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, n_out, device=device, dtype=torch.bfloat16)
    label = f"{case} d={d} tokens={tokens}"
    rows: list[Row] = []
    base_ms = None
    for name, make, compiled in variants(
        case in compile_cases, tokens, bias_grad_ab, mlp_ab and case == "block", tma_ab, bwd_ab
    ):
        short = name.removeprefix("switchback ")
        selected = any(o == short for o in only) if exact else any(o in name for o in only or ())
        if only and name != "bf16 nn.Linear" and not selected:
            continue
        row = Row(label, name)
        try:
            model = make(copy.deepcopy(ref))
            run_model = torch.compile(model) if compiled else model
            step = step_fn(run_model, x, grad)
            row.ms = do_bench(step, warmup=25, rep=100)
            row.saved_mib = saved_activation_mib(run_model, x)
            if name.startswith("switchback") and not compiled and device == "cuda":
                fused_act = _ACT_KIND[hidden_act] if is_fused_mlp(model) else None
                row.quant_ms = quant_ms(case, d, tokens, first_config(model), fused_act)
                if fused_act is not None:
                    row.variant += " [fused mlp]"
        except Exception as err:  # a peer that fails must not end the run; the table says why
            row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:90]}"
        if base_ms is None:
            base_ms = row.ms
        if row.ms is not None and base_ms:
            row.ratio = base_ms / row.ms
        rows.append(row)
        print(format_row(row), flush=True)
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_gemms(d: int, tokens: int) -> None:
    """Bare GEMMs of a block (operands already quantized): ours with and without the TMA kernel, and fp8 on
    cuBLAS (_scaled_mm), vs cuBLAS bf16."""
    for name, n, k in (("d->4d", 4 * d, d), ("4d->d", d, 4 * d)):
        a16 = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        base = do_bench(
            lambda a16=a16, w16=w16, bias=bias: torch.nn.functional.linear(a16, w16, bias), rep=100
        )
        cells = [f"cuBLAS bf16 {base:.3f} ms"]
        for qdtype in (torch.int8, torch.float8_e4m3fn):
            a_q, a_s = ops.quantize_rowwise(a16, qdtype)
            w_q, w_s = ops.quantize_tensorwise(w16, qdtype)
            # fp8: our Triton kernels (portable, TMA), then cuBLAS's row-wise _scaled_mm (kernels/cublas.py)
            paths = [("portable", False, "triton"), ("tma", True, "triton")]
            if qdtype != torch.int8:
                paths.append(("cublas", False, "cublas"))
            for tag, tma, fp8_gemm in paths:
                options = KernelOptions(use_tma=tma, fp8_gemm=fp8_gemm)
                ms = do_bench(
                    lambda a_q=a_q, w_q=w_q, a_s=a_s, w_s=w_s, bias=bias, options=options: ops.scaled_matmul(
                        a_q, w_q, a_s, w_s, bias, torch.bfloat16, options=options
                    ),
                    rep=100,
                )
                cells.append(f"{str(qdtype).split('.')[-1]} {tag} {ms:.3f} ms ({base / ms:.2f}x)")
        print(f"| gemm {name} d={d} M={tokens} | " + " | ".join(cells) + " |", flush=True)


def bench_row_kernels(d: int, tokens: int, act: str) -> None:
    """The (tokens, 4d) passes of a block, each alone: the fused kernels vs the torch ops they replace."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    h, g = torch.randn(tokens, 4 * d, **bf), torch.randn(tokens, 4 * d, **bf)
    approximate = "tanh" if act == "gelu_tanh" else "none"
    timings = {
        "torch gelu fwd": lambda: torch.nn.functional.gelu(h, approximate=approximate),
        "torch gelu bwd": lambda: torch.ops.aten.gelu_backward(g, h, approximate=approximate),
        "quantize_rowwise": lambda: ops.quantize_rowwise(h, torch.int8),
        "act_quantize_rowwise": lambda: ops.act_quantize_rowwise(h, torch.int8, act),
    }
    for impl in ("tiles", "rows"):

        def bwd(options=KernelOptions(act_backward_impl=impl)):  # noqa: B008 (bound per loop)
            return ops.act_backward_quantize_colsum(g, h, torch.int8, act, True, options=options)

        timings[f"act_backward_quantize_colsum ({impl})"] = bwd
    # The output-gradient quantize + column sum at both widths of a block (d: q/k/v/out_proj, fc2; 4d: fc1).
    for width in (d, 4 * d):
        grad = torch.randn(tokens, width, **bf)
        timings[f"quantize_rowwise_colsum (tokens, {width})"] = lambda grad=grad: ops.quantize_rowwise_colsum(
            grad, torch.int8
        )
    cells = [f"{name} {do_bench(fn, rep=50):.3f} ms" for name, fn in timings.items()]
    print(f"| row kernels ({tokens}, {4 * d}) bf16 | " + " | ".join(cells) + " |", flush=True)


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def format_row(r: Row) -> str:
    cells = [r.case, r.variant, _fmt(r.ms, ".3f"), _fmt(r.ratio, ".2f"), _fmt(r.saved_mib, ".0f")]
    return "| " + " | ".join([*cells, _fmt(r.quant_ms, ".3f"), r.note]) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dims", type=int, nargs="+", default=[768, 1024, 1280], help="model widths d")
    parser.add_argument("--tokens", type=int, nargs="+", default=[65536, 4096], help="rows (batch x seq)")
    parser.add_argument(
        "--cases",
        nargs="*",
        default=["fc1", "fc2", "block"],
        choices=["fc1", "fc2", "block"],
        help="what to time (none: only --kernels / --gemm)",
    )
    parser.add_argument(
        "--compile-cases",
        nargs="*",
        default=["block"],
        choices=["fc1", "fc2", "block"],
        help="cases that also get the torch.compile and torchao variants (each costs a compile)",
    )
    parser.add_argument("--only", nargs="*", help="run only variants whose name contains one of these")
    parser.add_argument(
        "--mlp-ab",
        action="store_true",
        help="add block variants with the fused MLP (fuse_mlp=True; separate layers are the default)",
    )
    parser.add_argument(
        "--tma-ab",
        action="store_true",
        help="add variants on the Hopper TMA GEMM (KernelOptions(use_tma=True); the portable one is the default)",
    )
    parser.add_argument("--gemm", action="store_true", help="also time the bare GEMMs of each d x tokens")
    parser.add_argument(
        "--kernels", action="store_true", help="also time the (tokens, 4d) row kernels one by one"
    )
    parser.add_argument(
        "--bwd-ab",
        action="store_true",
        help="add fused-block variants with the activation backward as a separate pass (tiles / rows)",
    )
    parser.add_argument(
        "--exact", action="store_true", help="--only names must equal a variant name (without 'switchback ')"
    )
    parser.add_argument(
        "--act",
        default="gelu_pytorch_tanh",
        choices=sorted(_ACT_KIND),
        help="the block's hidden_act (CLIP: quick_gelu for OpenAI configs, gelu for OpenCLIP-style)",
    )
    parser.add_argument(
        "--bias-grad-ab",
        action="store_true",
        help="add variants with the bias gradient as a separate pass (fused is the default)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: only with --tiny")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="smoke mode: d=16, 32 tokens, no compile rows, no --gemm/--kernels",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU; use --device cpu --tiny for a smoke run")
    if args.device == "cpu" and not args.tiny:
        parser.error("--device cpu times the torch reference kernels, meaningless at real sizes: add --tiny")
    if args.tiny:
        args.dims, args.tokens, args.compile_cases, args.gemm, args.kernels = (
            TINY_DIMS,
            TINY_TOKENS,
            [],
            False,
            False,
        )
    with contextlib.suppress(Exception):
        import torchao

        print(f"torchao {torchao.__version__}")
    print(" | ".join(f"{k} {v}" for k, v in versions(args.device, ("triton",)).items()))
    print("| case | variant | ms | x bf16 | saved MiB | quant ms | note |")
    print("|---|---|---:|---:|---:|---:|---|")
    for d in args.dims:
        for tokens in args.tokens:
            for case in args.cases:
                run_case(
                    case,
                    d,
                    tokens,
                    set(args.compile_cases),
                    args.only,
                    args.bias_grad_ab,
                    args.mlp_ab,
                    args.act,
                    args.tma_ab,
                    args.bwd_ab,
                    args.exact,
                    args.device,
                )
            if args.kernels:
                bench_row_kernels(d, tokens, _ACT_KIND[args.act])
            if args.gemm:
                bench_gemms(d, tokens)


if __name__ == "__main__":
    main()
