"""Speed of a CLIP / SigLIP training step: bf16 vs SwitchBack vs torchao float8.

Each row is an HF CLIPModel (SiglipModel for siglip-*) from examples/configs/<model>.json, random init and random
data: forward with the model's own loss, backward, AdamW (fused on CUDA), bf16 autocast, SDPA. Ratios are over
bf16 eager and over the fastest bf16 row of the same model and batch. Every finished row is printed as a JSON
line and rewritten to --json at once, so a killed process keeps what it measured.

    PYTHONPATH=src python benchmarks/bench_train.py --models vit-b-16 --compile layers \\
        --variants bf16+compile int8+compile --steps 10 --profile $OUT/prof --json $OUT/train.json
    PYTHONPATH=src python benchmarks/bench_train.py --device cpu --tiny --variants bf16 int8 --steps 1  # smoke
    PYTHONPATH=src python benchmarks/bench_train.py --models vit-b-16 --compile layers --processes 3 \\
        --variants bf16+compile fp8-all+compile  # each row in 3 interleaved processes, the median reported

Variants (then the row grammar of common.py: +ckpt, +budgetF, +compile, @B):
  bf16                     nn.Linear
  int8 / fp8[-TOKEN...]    SwitchBack, library defaults but the token floor pinned at 16,384 (rows measure the
                           8-bit path), changed by each TOKEN (below); int8-default keeps the library
                           default (on Hopper 8-bit per layer where the crossover table says it pays)
  torchao-float8-RECIPE    torchao float8 training on the encoder linears (tensorwise, rowwise, rowwise_with_gw_hp)
  BASE-lora                PEFT LoRA (rank 16) on every encoder linear of a bf16 / SwitchBack base, rest frozen
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf_switchback.compile_cache import allow_compile_cache, load_compile_artifacts, save_compile_artifacts
from hf_switchback.kernels import direct_kernel_calls, early_compile, tiled_quantize_configs

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import step_profile

CONFIG_DIR = Path(__file__).resolve().parent.parent / "examples" / "configs"
# per-GPU batch: what fits an 80 GB H100 without gradient checkpointing, in OpenCLIP's usual range
MODELS = {
    "vit-b-16": dict(config="clip-vit-b-16.json", batch=256),
    "vit-l-14": dict(config="clip-vit-l-14.json", batch=128),
    "vit-h-14": dict(config="clip-vit-h-14.json", batch=64),
    "siglip-b-16": dict(config="siglip-vit-b-16.json", batch=256),
}
TEXT_TOKENS = 77
TINY_TOWER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
TINY_BATCH = 8
VARIANTS = ("bf16", "bf16+compile", "int8", "int8+compile", "fp8", "fp8+compile")
ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")
# SwitchBackConfig fields each -TOKEN of a SwitchBack base sets, in the order they are matched
TOKENS = {
    "default": ({}, "no pinned token floor: the library default as is"),
    "int8grad": (dict(grad_precision="int8"), "int8 output gradients (the paper's; 'auto' is fp8 on Hopper)"),
    "fused": (dict(fuse_mlp=True), "each CLIP MLP as one fused op"),
    "unfused": (dict(fuse_mlp=False), "separate MLP layers (with memeff)"),
    "qkv": (dict(fuse_qkv=True), "q/k/v as one N = 3d GEMM with one input quantize"),
    "nonorm": (dict(fuse_norm=False), "LayerNorms leave the quantize to the next op"),
    "noact": (dict(fuse_activation=False), "the MLP activation leaves fc2's quantize to fc2"),
    "row": (dict(weight_scaling="row"), "row-wise weight scales"),
    "memeff": (dict(memory_efficient=True), "the memory switch: 8-bit saved inputs, MLPs fused"),
    "mlp": (dict(target_modules=("fc1", "fc2")), "only the MLP linears 8-bit"),
    "attn": (dict(target_modules=ATTENTION), "only the attention projections 8-bit"),
    "wgrad8": (dict(wgrad_precision="fp8"), "the weight-gradient GEMM in fp8 too"),
    "all": (dict(min_tokens=0), "no token floor: every linear 8-bit (the text tower too)"),
    "inductor-act": (dict(kernel_changes=dict(triton_act_quantize=False)), "fused MLP's act passes by Inductor"),
    "tma": (dict(kernel_changes=dict(use_tma=True)), "the Hopper TMA 8-bit GEMM (opaque under compile)"),
    "wcache": (dict(kernel_changes=dict(cache_weight_operands=True)), "weights quantized once per update"),
}  # fmt: skip
TOKENS_HELP = "TOKENs:\n" + "\n".join(f"  -{name:13} {text}" for name, (_, text) in TOKENS.items())
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
LORA_TARGETS = (*ATTENTION, "fc1", "fc2")
BASES_HELP = "bf16, int8/fp8[-TOKEN...] (see --help), torchao-float8-RECIPE, BASE-lora"
# A/B flag -> (KernelOptions field, value, help): each flips one default
KERNEL_FLAGS = {
    "tma": ("use_tma", True, "the Hopper TMA 8-bit GEMM instead of the portable one"),
    "opaque_gemm_under_compile": ("trace_gemm", False, "the 8-bit GEMM as an opaque op under compile"),
}  # fmt: skip


def switchback_fields(base: str) -> dict | None:
    """The SwitchBackConfig fields of a SwitchBack base (int8-memeff-unfused, ...); None if it is not one."""
    precision = base.partition("-")[0]
    if precision not in ("int8", "fp8"):
        return None
    fields, rest = dict(precision=precision), base.removeprefix(precision)
    while rest:
        token = next((t for t in TOKENS if rest == f"-{t}" or rest.startswith(f"-{t}-")), None)
        if token is None:
            return None
        fields.update(TOKENS[token][0])
        rest = rest[len(token) + 1 :]
    return fields


def is_base(base: str) -> bool:
    base = base.removesuffix("-lora")
    torchao = base.removeprefix("torchao-float8-") in TORCHAO_RECIPES
    return base == "bf16" or torchao or switchback_fields(base) is not None


def parse_variant(spec: str) -> common.Variant:
    return common.parse_variant(spec, is_base, BASES_HELP)


def spec_arg(spec: str) -> str:
    """argparse type of a row spec: a bad one is a usage error naming the problem."""
    try:
        parse_variant(spec)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return spec


def switchback_config(base: str, kernel_options=None, **changes):
    """SwitchBackConfig of a SwitchBack base, its kernel_changes on top of kernel_options, then `changes`."""
    from hf_switchback import KernelOptions, SwitchBackConfig

    fields = switchback_fields(base)
    options = (kernel_options or KernelOptions()).replace(**fields.pop("kernel_changes", {}))
    return SwitchBackConfig(**{**fields, **changes}, kernel_options=options)


def kernel_options(args: argparse.Namespace):
    from hf_switchback import KernelOptions

    flags = KERNEL_FLAGS.items()
    return KernelOptions(**{field: value for flag, (field, value, _) in flags if getattr(args, flag, False)})


def clip_config(name: str, tiny: bool = False):
    """CLIPConfig (SiglipConfig) of examples/configs/<model>.json; `tiny` shrinks both towers to CPU-test size."""
    from transformers import CLIPConfig, SiglipConfig

    path = CONFIG_DIR / MODELS[name]["config"]
    config = (SiglipConfig if name.startswith("siglip") else CLIPConfig).from_json_file(path)
    if tiny:
        for key, value in TINY_TOWER.items():
            setattr(config.text_config, key, value)
            setattr(config.vision_config, key, value)
        config.vision_config.image_size, config.vision_config.patch_size = 32, 8
        config.projection_dim = config.text_config.projection_dim = config.vision_config.projection_dim = 32
        config.text_config.vocab_size = 64
        if config.model_type == "siglip":
            config.text_config.projection_size = TINY_TOWER["hidden_size"]  # the text head's output width
    return config


def convert(model, base: str, device: str, kernel_opts=None):
    """Swap the linears of one row's base in place (bf16: none)."""
    from hf_switchback import apply_switchback
    from hf_switchback.functional import AUTO_MIN_TOKENS_CUDA

    if switchback_fields(base) is not None:
        config = switchback_config(base, kernel_opts)
        if torch.device(device).type == "cuda" and config.min_tokens is None and "-default" not in base:
            config = config.replace(min_tokens=AUTO_MIN_TOKENS_CUDA)  # the 8-bit path, as rows were measured
        apply_switchback(model, config)
    elif base.startswith("torchao-float8-"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = Float8LinearConfig.from_recipe_name(base.removeprefix("torchao-float8-"))
        # SwitchBack's coverage: encoder linears only, projections stay bf16
        encoder = lambda module, fqn: ".encoder.layers." in f".{fqn}"  # noqa: E731
        convert_to_float8_training(model, config=recipe, module_filter_fn=encoder)
    return model


def build_model(config, variant, grad_ckpt, compile_mode, device, inductor_mode="default", kernel_opts=None):
    """The CLIPModel / SiglipModel of one row (variant: BASE[+compile]), converted, compiled, in training mode."""
    from transformers import CLIPModel, SiglipModel

    with torch.device(device):  # ViT-H/14's random init on the CPU takes tens of seconds
        model = (SiglipModel if config.model_type == "siglip" else CLIPModel)(config).train()
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base = variant.removesuffix("+compile")
    model = convert(model, base.removesuffix("-lora"), device, kernel_opts)
    if base.endswith("-lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(LORA_TARGETS)))
    if not variant.endswith("+compile"):
        return model
    options = {} if inductor_mode == "default" else dict(mode=inductor_mode)
    if compile_mode == "model":
        return torch.compile(model, **options)
    # dynamic=False: one static graph per tower (their shapes differ) instead of a recompile with symbolic sizes
    for tower in (model.vision_model, model.text_model):
        for layer in tower.encoder.layers:
            layer.compile(dynamic=False, **options)
    return model


def random_batch(config, batch: int, device: str):
    """Token ids (eos last: CLIP pools at the first eos, SigLIP at the last) and pixels."""
    text_tokens = min(TEXT_TOKENS, config.text_config.max_position_embeddings)
    ids = torch.randint(4, config.text_config.vocab_size, (batch, text_tokens), device=device)
    ids[:, -1] = config.text_config.eos_token_id
    side = config.vision_config.image_size
    return ids, torch.randn(batch, 3, side, side, device=device)


def training_step(model, config, batch: int, device: str):
    """(forward() -> loss, finish(loss) -> loss: backward and AdamW step), split so that a caller can read the
    memory the forward leaves saved for backward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    ids, pixels = random_batch(config, batch, device)

    def forward() -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16):
            return model(input_ids=ids, pixel_values=pixels, return_loss=True).loss

    def finish(loss: torch.Tensor) -> torch.Tensor:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return forward, finish


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(step, steps: int, device: str):
    """Wall ms per call of `steps` calls of step(), and the last result."""
    t0, out = time.perf_counter(), None
    for _ in range(steps):
        out = step()
    synchronize(device)
    return (time.perf_counter() - t0) * 1000 / max(steps, 1), out


def row_batch(name: str, spec: common.Variant, args) -> int:
    return spec.batch or args.batch or (TINY_BATCH if args.tiny else MODELS[name]["batch"])


def first_step_profile_path(args, name: str, variant: str) -> Path | None:
    """--first_step_profile: a file of its own per process (compile_warmup.py runs one row per process)."""
    folder = getattr(args, "first_step_profile", None)
    if not folder:
        return None
    return Path(folder) / f"{name}_{variant.replace('+', '_')}_{time.time_ns()}.prof"


def run_row(name: str, variant: str, args, profile: bool = False, batch: int | None = None):
    """One training row: first step (compile + autotune), --warmup steps, one step split to read the memory its
    forward saves, --steps timed steps; with `profile`, --profile_steps more under torch.profiler."""
    spec, device = parse_variant(variant), args.device
    cuda = device == "cuda"
    batch = batch or row_batch(name, spec, args)
    if spec.compiled:
        # as train_clip.py --torch_compile, before the model loads: a warm start launches our kernels from the
        # cache, and Inductor's compile workers start now (--late_compile_workers: at the first compile)
        allow_compile_cache(start_workers=not getattr(args, "late_compile_workers", False))
    with common.recompute_budget(spec.budget):
        config = clip_config(name, tiny=args.tiny)
        inductor_mode, options = getattr(args, "compile_mode", "default"), kernel_options(args)
        model_variant = spec.base + ("+compile" if spec.compiled else "")
        model = build_model(
            config, model_variant, spec.grad_ckpt, args.compile, device, inductor_mode, options
        )
        forward, finish = training_step(model, config, batch, device)
        artifacts = getattr(args, "compile_artifacts", None)
        if artifacts:  # before the first step, where the model compiles
            load_compile_artifacts(artifacts)
        caches_before, phases_before = common.cache_counts(), common.compile_phase_seconds()
        compiles_before, early_before = common.compiles_so_far(), early_compile.stats["submitted"]
        one_config_before = tiled_quantize_configs.stats["one_config"]
        rewritten_before = direct_kernel_calls.stats["rewritten"]
        with (
            common.python_profile(first_step_profile_path(args, name, variant)),
            common.ttir_generation() as ttir,
        ):
            first_step_s, _ = timed(lambda: finish(forward()), 1, device)
        first_step_s /= 1000
        if artifacts:
            save_compile_artifacts(artifacts)
        row = dict(model=name, variant=variant, batch=batch, first_step_s=first_step_s)
        row["first_step_caches"] = common.first_step_caches(caches_before, common.cache_counts())
        phases = common.compile_phase_seconds()
        row["first_step_compile_s"] = {k: round(v - phases_before.get(k, 0.0), 3) for k, v in phases.items()}
        row["first_step_ttir"] = ttir  # torch's TTIR generations of our kernels: calls and seconds
        row["first_step_kernel_compiles"] = common.kernel_compiles_since(compiles_before)  # per graph
        # our kernels handed to the compile workers when Inductor wrote their launch (kernels/early_compile.py)
        row["first_step_early_kernels"] = early_compile.stats["submitted"] - early_before
        # Inductor's transposed 8-bit writes generated with one tile config (kernels/tiled_quantize_configs.py)
        row["first_step_one_config_kernels"] = tiled_quantize_configs.stats["one_config"] - one_config_before
        # our kernels' calls made mutating without torch's per-call tracing (kernels/direct_kernel_calls.py)
        row["first_step_direct_kernel_calls"] = direct_kernel_calls.stats["rewritten"] - rewritten_before
        timed(lambda: finish(forward()), args.warmup, device)
        if cuda:  # steady state, not the compile / autotune step
            torch.cuda.reset_peak_memory_stats()
        resting = torch.cuda.memory_allocated() if cuda else 0
        loss = forward()
        synchronize(device)
        saved = torch.cuda.memory_allocated() - resting if cuda else 0
        finish(loss)
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
        with common.gpu_clocks(cuda) as clocks:  # the SM clock and power the timed steps ran at
            ms, loss = timed(lambda: finish(forward()), args.steps, device)
        row.update(clocks)
        if not torch.isfinite(loss).item():
            raise FloatingPointError(f"loss is {loss.item()}")
        row.update(ms_per_step=ms, samples_per_s=batch * 1000 / ms, loss=loss.item(), peak_mem_gib=None)
        if cuda:
            peak = torch.cuda.max_memory_allocated()
            fixed = resting + sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            row.update(peak_mem_gib=peak / 2**30, fixed_gib=fixed / 2**30)
            # Times the caching allocator found no free block, freed its cache (a device-wide synchronize) and
            # retried, over the timed steps: memory pressure that stalls the host, not the GPU.
            row["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
            per_sample = dict(saved_mib_per_sample=saved, peak_mib_per_sample=peak - fixed)
            row.update({key: value / batch / 2**20 for key, value in per_sample.items()})
        if profile:  # after the row's figures, so the profiled steps do not enter its peak memory
            path = Path(args.profile) / f"{name}_{variant.replace('+', '_').replace('@', '_b')}.json"
            title = f"{name} {variant} batch {batch}: {args.profile_steps} steps profiled, {ms:.1f} ms/step"
            try:
                steps = args.profile_steps
                row["profile"] = step_profile.profile_row(forward, finish, steps, device, path, title)
            except Exception as err:  # a profiler failure must not lose the row's figures
                row["profile_error"] = repr(err)[:300]
    return row


def cleanup(device: str) -> None:
    """Free the last row's model, optimizer state and compiled graphs before the next row is built."""
    torch._dynamo.reset()  # compiled code holds the model's parameters through its guards
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def attempt(key: dict, device: str, clock: common.Clock | None, run, *run_args) -> dict:
    """run(*run_args) -> row, with a failure recorded in the row instead of raised (status oom or error), and a row that
    cannot run here (torchao missing) or would overrun the time budget recorded as skipped."""
    reason = None
    if "torchao" in key["variant"] and importlib.util.find_spec("torchao") is None:
        reason = "torchao is not installed (pip install torchao; on the GPU machine carry it as a wheel)"
    elif clock is not None and not clock.allows(key["model"]):
        reason = f"time budget ({clock.elapsed():.0f} s used)"
    if reason is not None:
        return dict(key, status="skipped", error=reason)
    t0 = time.perf_counter()
    try:
        row = run(*run_args)
    except Exception as err:  # one failing row must not lose the rest of the table
        oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
        row = dict(key, status="oom" if oom else "error", error=repr(err)[:300])
    cleanup(device)  # after the except block, so the traceback no longer pins the model
    row["row_s"] = time.perf_counter() - t0
    if clock is not None:
        clock.record(key["model"], row["row_s"])
    return row


def print_table(rows: list[dict]) -> None:
    eager, best = {}, {}  # bf16 eager and the fastest bf16 row of any kind, per (model, batch)
    for r in rows:
        if "ms_per_step" in r and parse_variant(r["variant"]).base == "bf16":
            key = (r["model"], r["batch"])
            best[key] = min(best.get(key, math.inf), r["ms_per_step"])
            if r["variant"].partition("@")[0] == "bf16":
                eager[key] = r["ms_per_step"]
    cols = [("batch", lambda r: r["batch"], "d"), ("ms/step", lambda r: r["ms_per_step"], ".1f")]
    cols += [("samples/s", lambda r: r["samples_per_s"], ".0f")]
    for title, ref in (("vs bf16", eager), ("vs best bf16", best)):
        vs = lambda r, ref=ref: common.ratio(ref.get((r["model"], r["batch"])), r["ms_per_step"])  # noqa: E731
        cols.append((title, vs, ""))
    cols += [
        ("peak GiB", lambda r: r["peak_mem_gib"], ".1f"),
        ("1st step s", lambda r: r["first_step_s"], ".1f"),
        ("SM MHz", lambda r: r.get("sm_clock_mhz"), ".0f"),
        ("W", lambda r: r.get("power_w"), ".0f"),
    ]
    lead = [("model", "model", 11), ("variant", "variant", 42)]
    common.print_table(rows, lead, cols, "ms_per_step")
    for r in rows:
        if "ms_per_step_processes" in r:  # --processes: the spread behind each median
            spread = " / ".join(f"{ms:.1f}" for ms in r["ms_per_step_processes"])
            print(f"{r['model']} {r['variant']}: ms/step per process {spread}")
    step_profile.print_profiles(rows)


def run(args: argparse.Namespace) -> list[dict]:
    """Every (model, variant) row in order; prints and saves each as it finishes."""
    env = dict(common.versions(args.device), args=vars(args))
    print(json.dumps(env), flush=True)
    clock, rows = common.Clock(args.time_budget_s), []
    for name in args.models:
        for variant in args.variants:
            key = dict(model=name, variant=variant)
            rows.append(attempt(key, args.device, clock, run_row, name, variant, args, bool(args.profile)))
            common.emit(rows, env, args.json)
    print_table(rows)
    return rows


def median_row(samples: list[dict]) -> dict:
    """One row for the samples of a (model, variant) measured in several processes: the sample whose step time
    is the (lower) median, with every process's step time (`ms_per_step_processes`); the first failure when
    no process measured it."""
    measured = sorted((r for r in samples if "ms_per_step" in r), key=lambda r: r["ms_per_step"])
    if not measured:
        return samples[0]
    times = [r["ms_per_step"] for r in samples if "ms_per_step" in r]
    return dict(measured[(len(measured) - 1) // 2], ms_per_step_processes=times, processes=len(samples))


def run_in_processes(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    """Every row in --processes fresh processes, interleaved (each row once, then each again), so that what
    differs between processes (the host's speed, where the step is host-bound) spreads over every row alike;
    the median process per row is reported (median_row)."""
    child = common.without_flags(argv, {"--models", "--variants", "--processes", "--json"})
    env = dict(common.versions(args.device), args=vars(args))
    print(json.dumps(env), flush=True)
    samples: dict[tuple[str, str], list[dict]] = {}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        for repeat in range(args.processes):
            for name in args.models:
                for variant in args.variants:
                    out = Path(tmp) / f"{repeat}_{name}_{variant}.json"
                    command = [__file__, *child, "--models", name, "--variants", variant, "--json", str(out)]
                    row = dict(common.row_in_process(command, out), model=name, variant=variant)
                    samples.setdefault((name, variant), []).append(row)
                    print(json.dumps(dict(row, process=repeat)), flush=True)
                    rows = [median_row(s) for s in samples.values()]
                    if args.json:  # after each process, so a killed run keeps what it measured
                        Path(args.json).write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    print_table(rows)
    return rows


def add_row_flags(parser, variants, steps: int, warmup: int) -> None:
    """The flags bench_train.py and bench_memory.py share."""
    vits = [m for m in MODELS if m.startswith("vit")]
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=vits, help="default: the ViTs")
    parser.add_argument(
        "--variants", nargs="+", default=list(variants), type=spec_arg, metavar="SPEC", help="see above"
    )
    parser.add_argument("--batch", type=int, default=None, help="per-step batch (default: per model)")
    parser.add_argument("--compile", choices=("model", "layers"), default="model", help="+compile's scope")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps after the first one")
    parser.add_argument("--time_budget_s", type=float, help="skip runs that would end past this (seconds)")
    parser.add_argument("--json", default=None, help="also write the rows here (after every row)")
    parser.add_argument("--profile", metavar="DIR", help="GPU ms by kernel family per row (step_profile.py)")
    parser.add_argument("--profile_steps", type=int, default=2, help="steps profiled per row with --profile")
    common.add_smoke_flags(parser)


def main() -> None:
    parser = common.parser_of(__doc__, epilog=TOKENS_HELP)
    add_row_flags(parser, VARIANTS, steps=10, warmup=3)
    modes = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
    parser.add_argument("--compile_mode", choices=modes, default="default", help="of the +compile rows")
    parser.add_argument(
        "--late_compile_workers",
        action="store_true",
        help="A/B: Inductor's compile workers start at the first compile (torch's default), not at the row's "
        "start as train_clip.py starts them (compile_cache.start_compile_workers)",
    )
    for flag, (field, value, text) in KERNEL_FLAGS.items():
        parser.add_argument(f"--{flag}", action="store_true", help=f"A/B: {text} ({field}={value})")
    # one row per process: a second save of one process reads back as only what it added
    parser.add_argument("--compile_artifacts", metavar="FILE", help="torch.compile's caches: load, then save")
    parser.add_argument(
        "--first_step_profile",
        metavar="DIR",
        help="cProfile each row's first step (compile + autotune) into DIR: where the host's seconds go",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="time every row in N fresh processes, interleaved, and report the median: a host-bound step "
        "moves between processes by up to 13%% (BENCHMARKS.md, width 768 depends on the host)",
    )
    args = parser.parse_args()
    if args.compile_artifacts and len(args.models) * len(args.variants) > 1:
        parser.error("--compile_artifacts measures one row per process: pass one model and one variant")
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}")
    if args.processes > 1 and (args.profile or args.compile_artifacts or args.time_budget_s):
        parser.error(
            "--processes runs each row in processes of its own: drop --profile, --compile_artifacts "
            "and --time_budget_s (run one process for those)"
        )
    if (
        args.compile_mode == "reduce-overhead"
        and args.compile == "layers"
        and any("+ckpt" in v for v in args.variants)
    ):
        # the checkpoint recompute replays a layer's CUDA graph while its first outputs are still needed
        parser.error("--compile_mode reduce-overhead with +ckpt rows needs --compile model")
    common.check_device(parser, args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.processes > 1:
        run_in_processes(args, sys.argv[1:])
    else:
        run(args)


if __name__ == "__main__":
    main()
