"""End-to-end CLIP / SigLIP training step speed: bf16 vs SwitchBack vs torchao float8, one process, one table.

Each row is one HF CLIPModel (SiglipModel for siglip-*) built from examples/configs/<model>.json (random init,
no download) trained on random data: forward with the model's own loss (CLIP's contrastive, SigLIP's sigmoid;
transformers' return_loss), backward, AdamW step (fused on CUDA), bf16 autocast, SDPA
attention. Ratios are against bf16 eager and against the fastest bf16 row of the same model and batch (plain,
+compile, +budgetF, +ckpt: the best bf16 a user would run) measured in the same run. Every finished row is
printed as one JSON line and rewritten to --json at once, so a killed process keeps what it measured.

    PYTHONPATH=.whl/site:src python benchmarks/bench_train.py --models vit-b-16 --time_budget_s 500 \
        --json $OUT/train_b16.json
    PYTHONPATH=src python benchmarks/bench_train.py --models vit-h-14 --batch 192 --variants \
        bf16+budget0.75+compile bf16+ckpt+compile int8-memeff+compile --steps 10 --profile $OUT/prof
    PYTHONPATH=src python benchmarks/bench_train.py --device cpu --tiny --variants bf16 int8 --steps 1  # smoke

Variants:
  int8 / fp8             SwitchBack with the library defaults except the token floor, pinned at 16,384 (a call
                         with fewer tokens runs the bf16 matmul: at ViT-H/14 batch 64 the text tower stays bf16).
                         Every variant below pins it too, so the rows measure the 8-bit path.
  int8-default           the library default as is: on Hopper the measured per-shape table
                         (kernels/crossover/sm90.json) keeps nearly every CLIP linear bf16.
  int8-int8grad          grad_precision="int8": int8 gradients too (the paper's SwitchBack). Plain int8 uses
                         the default grad_precision="auto", which on GPUs with fp8 tensor cores quantizes the
                         output gradients to fp8 (BENCHMARKS.md, Accuracy: int8 gradients lost it).
  int8-fused             fuse_mlp=True: each CLIP MLP as one fused SwitchBack op (less activation memory).
  int8-qkv / fp8-qkv     fuse_qkv=True: q/k/v of each attention block as one op (one input quantize, one
                         N = 3d GEMM forward and grad-input).
  int8-triton            backend="triton": every swapped linear quantizes, whatever its token count. Shows what
                         the floor is worth; at ViT-B/16 batch 256 both towers are above it, so it equals int8.
  int8-row-memeff        row-wise weight scales and the memory switch (memory_efficient=True: 8-bit saved
                         inputs, each MLP fused). int8-memeff / fp8-memeff: the switch alone (-unfused: separate
                         MLP layers); benchmarks/bench_memory.py measures what it buys.
  int8-mlp / fp8-mlp     only the MLP linears (fc1, fc2) 8-bit; attention projections stay bf16.
  fp8-wgrad8             wgrad_precision="fp8": the weight-gradient GEMM in fp8 too (cuBLAS), all three GEMMs of
                         each linear 8-bit; fp8-memeff-wgrad8 with the memory switch.
  int8-attn              only the attention projections (q/k/v/out_proj) 8-bit: with int8-mlp, shows which
                         linears pay for their quantize passes.
  torchao-float8-<recipe> torchao's float8 training on the same linears (encoder layers; projections stay bf16).
  bf16-lora / int8-lora / fp8-lora   PEFT LoRA (rank 16) on every encoder linear of a bf16 or SwitchBack base, the
                         rest frozen (needs peft): the frozen 8-bit base runs forward and grad-input only.
  +compile, +ckpt, +budgetF, @B   the row grammar of benchmarks/common.py. +compile compiles the whole model
                         (--compile model, the default: what a user runs); --compile layers compiles each encoder
                         layer instead (one graph per tower, reused by all its layers: compiles much faster).

--profile DIR: after a row's figures, GPU ms per step by kernel family (benchmarks/step_profile.py: 16-bit GEMM,
8-bit GEMM, quantize/cast, attention, norm + elementwise, optimizer, other), printed as a table after the rows,
in the row's JSON and in DIR/<model>_<variant>.json beside the full text report (on the CPU, CPU ops stand in
for kernels: a smoke test).

Needs CUDA except for the --device cpu smoke mode. A row that fails (out of memory, torchao missing, a kernel
error) is recorded with its error and the table goes on; with --time_budget_s, rows that would not finish in the
budget are recorded as skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from hf_switchback.compile_cache import allow_compile_cache, load_compile_artifacts, save_compile_artifacts

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import step_profile
from common import cache_counts, first_step_caches, first_step_split, phase_totals

CONFIG_DIR = Path(__file__).resolve().parent.parent / "examples" / "configs"
# per-GPU batch: what fits an 80 GB H100 without gradient checkpointing, in OpenCLIP's usual range
MODELS = {
    "vit-b-16": dict(config="clip-vit-b-16.json", batch=256),
    "vit-l-14": dict(config="clip-vit-l-14.json", batch=128),
    "vit-h-14": dict(config="clip-vit-h-14.json", batch=64),
    "siglip-b-16": dict(config="siglip-vit-b-16.json", batch=256),
}
TEXT_TOKENS = 77
# --tiny: the same model family at CPU-test size (the smoke mode and tests/test_benchmarks.py)
TINY_TOWER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
TINY_BATCH = 8
VARIANTS = (
    "bf16",
    "bf16+compile",
    "int8",
    "int8+compile",
    "int8-triton+compile",
    "int8-row-memeff+compile",
    "fp8",
    "fp8+compile",
    "torchao-float8-tensorwise+compile",
    "torchao-float8-rowwise_with_gw_hp+compile",
)
# SwitchBack rows: the SwitchBackConfig fields each one sets (the library defaults otherwise)
SWITCHBACK_VARIANTS = {
    "int8": {},
    "int8-default": {},
    "int8-int8grad": dict(grad_precision="int8"),
    "int8-fused": dict(fuse_mlp=True),
    "int8-qkv": dict(fuse_qkv=True),
    "fp8-qkv": dict(precision="fp8", fuse_qkv=True),
    "int8-triton": dict(backend="triton"),
    "int8-row-memeff": dict(weight_scaling="row", memory_efficient=True),
    "int8-mlp": dict(target_modules=("fc1", "fc2")),
    "int8-attn": dict(target_modules=("q_proj", "k_proj", "v_proj", "out_proj")),
    "fp8": dict(precision="fp8"),
    "fp8-mlp": dict(precision="fp8", target_modules=("fc1", "fc2")),
    # wgrad_precision="fp8": all three GEMMs of each linear in fp8 (opt-in beyond the paper)
    "fp8-wgrad8": dict(precision="fp8", wgrad_precision="fp8"),
    "fp8-memeff-wgrad8": dict(precision="fp8", memory_efficient=True, wgrad_precision="fp8"),
    # the memory switch as users get it: 8-bit saved inputs, each MLP fused (fuse_mlp follows memory_efficient);
    # -fused names it explicitly (the same config), -unfused keeps separate MLP layers (the A/B)
    "int8-memeff": dict(memory_efficient=True),
    "int8-memeff-fused": dict(memory_efficient=True, fuse_mlp=True),
    "int8-memeff-unfused": dict(memory_efficient=True, fuse_mlp=False),
    "fp8-memeff": dict(precision="fp8", memory_efficient=True),
    "fp8-memeff-fused": dict(precision="fp8", memory_efficient=True, fuse_mlp=True),
    "fp8-memeff-unfused": dict(precision="fp8", memory_efficient=True, fuse_mlp=False),
    # the A/B of KernelOptions.triton_act_quantize: the fused MLP's activation passes left to Inductor
    "int8-memeff-inductor-act": dict(memory_efficient=True, kernel_changes=dict(triton_act_quantize=False)),
    "fp8-memeff-inductor-act": dict(
        precision="fp8", memory_efficient=True, kernel_changes=dict(triton_act_quantize=False)
    ),
}
# -lora: PEFT LoRA adapters (rank 16) on every encoder linear, the rest of the model frozen, on a bf16 or
# SwitchBack base. The frozen base linears need no weight gradient, so a SwitchBack base runs all of its GEMMs
# in 8 bits.
LORA_BASES = ("bf16", "int8", "fp8")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
BASES = ("bf16", *SWITCHBACK_VARIANTS, "torchao-float8-tensorwise")
BASES += ("torchao-float8-rowwise", "torchao-float8-rowwise_with_gw_hp")
BASES += tuple(f"{base}-lora" for base in LORA_BASES)


def parse_variant(spec: str) -> common.Variant:
    """A row spec (BASE[+ckpt][+budgetF][+compile][@B]) with its base checked against BASES."""
    return common.parse_variant(spec, BASES)


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


def kernel_options(args: argparse.Namespace):
    """The KernelOptions of the A/B flags (each flag flips one field from its default)."""
    from hf_switchback import KernelOptions

    flag = lambda name: getattr(args, name, False)  # noqa: E731
    return KernelOptions(
        direct_eager=not flag("custom_op_eager"),
        fuse_quantize_under_compile=not flag("triton_quantize_under_compile"),
        trace_gemm=not flag("opaque_gemm_under_compile"),
        triton_grad_quantize=not flag("inductor_grad_quantize"),
        **({"use_tma": True} if flag("tma") else {}),
    )


def switchback_config(base: str, kernel_options=None, **changes):
    """The SwitchBackConfig of a SwitchBack row (SWITCHBACK_VARIANTS[base]), its kernel_changes applied to
    kernel_options (default KernelOptions()), then `changes`."""
    from hf_switchback import KernelOptions, SwitchBackConfig

    fields = dict(SWITCHBACK_VARIANTS[base])
    options = (kernel_options or KernelOptions()).replace(**fields.pop("kernel_changes", {}))
    return SwitchBackConfig(**{**fields, **changes}, kernel_options=options)


def build_model(
    config,
    variant: str,
    grad_ckpt: bool,
    compile_mode: str,
    device: str,
    inductor_mode: str = "default",
    kernel_options=None,
):
    """The CLIPModel / SiglipModel of one table row, converted and (for +compile) compiled, in training mode."""
    from transformers import CLIPModel, SiglipModel

    from hf_switchback import apply_switchback
    from hf_switchback.functional import AUTO_MIN_TOKENS_CUDA

    with torch.device(device):  # init on the GPU: ViT-H/14's random init on the CPU takes tens of seconds
        model = (SiglipModel if config.model_type == "siglip" else CLIPModel)(config)
    model.train()  # HF only checkpoints in training mode
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base = variant.removesuffix("+compile")
    lora = base.endswith("-lora")
    base = base.removesuffix("-lora")
    if base in SWITCHBACK_VARIANTS:
        config = switchback_config(base, kernel_options)
        if torch.device(device).type == "cuda" and config.min_tokens is None and base != "int8-default":
            # the 8-bit path above the 16,384-token floor, as every row here was measured; int8-default is the
            # library default (on Hopper the per-shape table keeps nearly every CLIP linear 16-bit)
            config = config.replace(min_tokens=AUTO_MIN_TOKENS_CUDA)
        apply_switchback(model, config)
    elif base.startswith("torchao-float8-"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        # same coverage as SwitchBack's defaults: encoder linears only, projections stay bf16
        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(base.removeprefix("torchao-float8-")),
            module_filter_fn=lambda module, fqn: ".encoder.layers." in f".{fqn}",
        )
    elif base != "bf16":
        raise ValueError(f"unknown variant {variant!r}; choose from {BASES} (+compile)")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(LORA_TARGETS)))
    if not variant.endswith("+compile"):
        return model
    allow_compile_cache()  # as train_clip.py --torch_compile: a warm start loads the traced layers
    options = {} if inductor_mode == "default" else dict(mode=inductor_mode)
    if compile_mode == "model":
        return torch.compile(model, **options)
    # dynamic=False: the vision and text layers have different shapes; without it the second shape would make
    # dynamo recompile the shared layer code with symbolic sizes instead of one static graph per tower
    for tower in (model.vision_model, model.text_model):
        for layer in tower.encoder.layers:
            layer.compile(dynamic=False, **options)
    return model


def training_step(model, config, batch: int, device: str):
    """(forward, finish) of one training step on random data: forward() -> loss (bf16 autocast, the model's own
    contrastive or sigmoid loss); finish(loss) runs backward and a fused AdamW step, and returns the loss. Split in two so a caller can
    look at the memory the forward leaves saved for backward (benchmarks/bench_memory.py)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    side = config.vision_config.image_size
    text_tokens = min(TEXT_TOKENS, config.text_config.max_position_embeddings)
    ids = torch.randint(4, config.text_config.vocab_size, (batch, text_tokens), device=device)
    ids[:, -1] = config.text_config.eos_token_id  # CLIP pools at the first eos token, SigLIP at the last
    pixels = torch.randn(batch, 3, side, side, device=device)

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


def timed_steps(step, steps: int, device: str) -> tuple[float, torch.Tensor]:
    """Wall ms per step of `steps` calls of step() -> loss, and the last loss (a non-finite one raises)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    synchronize(device)
    ms = (time.perf_counter() - t0) * 1000 / steps
    if not torch.isfinite(loss).item():
        raise FloatingPointError(f"loss is {loss.item()}")
    return ms, loss


def time_training(
    name: str, variant: str, grad_ckpt: bool, steps: int, warmup: int, args: argparse.Namespace
) -> dict:
    """One row: first step (compile + autotune) time, then `steps` timed steps after `warmup` untimed ones."""
    spec = parse_variant(variant)
    with common.recompute_budget(spec.budget):
        return _time_training(name, variant, spec, grad_ckpt or spec.grad_ckpt, steps, warmup, args)


def _time_training(name, variant, spec, grad_ckpt, steps, warmup, args) -> dict:
    device = args.device
    config = clip_config(name, tiny=args.tiny)
    batch = spec.batch or args.batch or (TINY_BATCH if args.tiny else MODELS[name]["batch"])
    model = build_model(
        config,
        spec.base + ("+compile" if spec.compiled else ""),
        grad_ckpt,
        args.compile,
        device,
        getattr(args, "compile_mode", "default"),
        kernel_options(args),
    )
    forward, finish = training_step(model, config, batch, device)

    def step() -> torch.Tensor:
        return finish(forward())

    if args.compile_artifacts:  # before the first step, where the model compiles
        load_compile_artifacts(args.compile_artifacts)
    compile_before, caches_before = phase_totals(), cache_counts()
    t0 = time.perf_counter()
    loss = step()
    synchronize(device)
    first_step_s = time.perf_counter() - t0
    if args.compile_artifacts:
        save_compile_artifacts(args.compile_artifacts)
    split = first_step_split(compile_before, phase_totals(), first_step_s)
    caches = first_step_caches(caches_before, cache_counts())
    for _ in range(warmup):
        loss = step()
    synchronize(device)
    if device == "cuda":
        # steady state: parameters, gradients' high-water mark and optimizer state, not the compile/autotune step
        torch.cuda.reset_peak_memory_stats()
    ms, loss = timed_steps(step, steps, device)
    row = dict(
        model=name,
        variant=variant,
        grad_ckpt=grad_ckpt,
        batch=batch,
        ms_per_step=ms,
        samples_per_s=batch * 1000 / ms,
        peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        first_step_s=first_step_s,
        first_step_split=split,
        first_step_caches=caches,
        loss=loss.item(),
    )
    if args.profile:  # after the row's figures, so the profiled steps do not enter its peak memory
        path = Path(args.profile) / f"{name}_{variant.replace('+', '_').replace('@', '_b')}.txt"
        title = f"{name} {variant} batch {batch}: {args.profile_steps} steps profiled, timed {ms:.1f} ms/step"
        row["profile"] = step_profile.profile_row(forward, finish, args.profile_steps, device, path, title)
    return row  # model, optimizer and compiled code are freed by the caller's cleanup()


def cleanup(device: str) -> None:
    """Free the last row's model, optimizer state and compiled graphs before the next row is built."""
    torch._dynamo.reset()  # compiled code holds the model's parameters through its guards
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def estimate_s(durations: dict, name: str, variant: str) -> float:
    """Rough cost of a row from the rows of the same model already run (0 when nothing is known)."""
    compiled = variant.endswith("+compile")
    same = durations.get((name, compiled))
    if same:
        return max(same)
    eager = durations.get((name, False))
    return 2 * max(eager) + 30 if compiled and eager else 0.0


def print_table(rows: list[dict]) -> None:
    eager, best = {}, {}  # bf16 eager per (model, batch); the fastest bf16 row of any kind per (model, batch)
    for r in rows:
        if "ms_per_step" in r and parse_variant(r["variant"]).base == "bf16":
            key = (r["model"], r["batch"])
            best[key] = min(best.get(key, math.inf), r["ms_per_step"])
            if r["variant"].partition("@")[0] == "bf16" and not r["grad_ckpt"]:
                eager[key] = r["ms_per_step"]
    common.print_header(
        f"{'model':11} {'ckpt':5} {'variant':42} {'batch':>5} {'ms/step':>8} {'samples/s':>9} {'vs bf16':>7} "
        f"{'vs best bf16':>12} {'peak GiB':>8} {'1st step s':>10}"
    )
    for r in rows:
        lead = f"{r['model']:11} {r['grad_ckpt']!s:5} {r['variant']:42}"
        if "ms_per_step" not in r:
            print(f"{lead} {r.get('status', 'error')}: {r.get('error', '')}")
            continue
        key = (r["model"], r["batch"])
        vs_e, vs_best = (
            common.ratio(eager.get(key), r["ms_per_step"]),
            common.ratio(best.get(key), r["ms_per_step"]),
        )
        mem = f"{r['peak_mem_gib']:8.1f}" if r["peak_mem_gib"] is not None else f"{'-':>8}"
        print(
            f"{lead} {r['batch']:5} {r['ms_per_step']:8.1f} {r['samples_per_s']:9.0f} {vs_e:>7} {vs_best:>12} "
            f"{mem} {r['first_step_s']:10.1f}"
        )
    step_profile.print_profiles(rows)


def environment(args: argparse.Namespace) -> dict:
    return dict(common.versions(args.device), args=vars(args))


def run(args: argparse.Namespace) -> list[dict]:
    """Every (model, grad_ckpt, variant) row in order; prints and saves each as it finishes."""
    env = environment(args)
    print(json.dumps(env), flush=True)
    start = time.perf_counter()
    ckpts = {"off": [False], "on": [True], "both": [False, True]}[args.grad_ckpt]
    rows: list[dict] = []
    durations: dict = {}
    for name in args.models:
        for grad_ckpt in ckpts:
            for variant in args.variants:
                key = dict(model=name, variant=variant, grad_ckpt=grad_ckpt)
                elapsed = time.perf_counter() - start
                if args.time_budget_s and elapsed + estimate_s(durations, name, variant) > args.time_budget_s:
                    rows.append(dict(key, status="skipped", error=f"time budget ({elapsed:.0f} s used)"))
                else:
                    t0 = time.perf_counter()
                    try:
                        rows.append(
                            dict(time_training(name, variant, grad_ckpt, args.steps, args.warmup, args))
                        )
                    except Exception as err:  # one failing row must not lose the rest of the table
                        rows.append(dict(key, status="error", error=repr(err)[:300]))
                    cleanup(args.device)  # after the except block, so the traceback no longer pins the model
                    row_s = time.perf_counter() - t0
                    rows[-1]["row_s"] = row_s
                    durations.setdefault((name, variant.endswith("+compile")), []).append(row_s)
                common.emit(rows, env, args.json)
    print_table(rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=[m for m in MODELS if m.startswith("vit")],
        help="model sizes (default: the CLIP ones)",
    )
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), metavar="SPEC", help="table rows (see above)"
    )
    parser.add_argument(
        "--grad_ckpt",
        choices=("off", "on", "both"),
        default="off",
        help="gradient checkpointing of both towers",
    )
    parser.add_argument(
        "--compile",
        choices=("model", "layers"),
        default="model",
        help="what +compile rows compile: the whole model (default) or each encoder layer",
    )
    parser.add_argument(
        "--compile_mode",
        choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
        default="default",
        help="torch.compile mode of the +compile rows; reduce-overhead replays CUDA graphs, for steps that are "
        "host-bound (wall time well above GPU time in --profile)",
    )
    parser.add_argument("--batch", type=int, default=None, help="per-step batch (default: per model)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first (compile) step")
    parser.add_argument(
        "--time_budget_s", type=float, default=None, help="skip rows that would end past this many seconds"
    )
    parser.add_argument(
        "--json", default=None, help="also write the rows to this JSON file (after every row)"
    )
    parser.add_argument(
        "--custom_op_eager",
        action="store_true",
        help="A/B: eager calls through the torch.library custom ops (the default calls the Triton launchers)",
    )
    parser.add_argument(
        "--triton_quantize_under_compile",
        action="store_true",
        help="A/B: keep our Triton quantize kernels under torch.compile (the default lets Inductor fuse them)",
    )
    parser.add_argument(
        "--opaque_gemm_under_compile",
        action="store_true",
        help="A/B: under torch.compile call the 8-bit GEMM as an opaque custom op (the default lets Inductor "
        "launch it from its generated code)",
    )
    parser.add_argument(
        "--inductor_grad_quantize",
        action="store_true",
        help="A/B: under torch.compile let Inductor quantize the output gradients too (the default runs our "
        "one-pass Triton kernel there)",
    )
    parser.add_argument(
        "--tma",
        action="store_true",
        help="A/B: the Hopper TMA 8-bit GEMM instead of the portable one (default)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after timing, profile --profile_steps more steps of each row: GPU ms by kernel family printed, "
        "in the row's JSON and DIR/<model>_<variant>.json, the top kernels in DIR/<model>_<variant>.txt "
        "('+' written '_')",
    )
    parser.add_argument("--profile_steps", type=int, default=2, help="steps profiled per row with --profile")
    parser.add_argument(
        "--compile_artifacts",
        default=None,
        metavar="FILE",
        help="load torch.compile's cache artifacts from FILE (when it exists) before the first step and write "
        "them there after it (hf_switchback.compile_cache); one row per process (compile_warmup.py --moved)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke test only")
    parser.add_argument("--tiny", action="store_true", help="shrink the models to CPU-test size (smoke test)")
    args = parser.parse_args()
    if args.compile_artifacts and (len(args.models) * len(args.variants) > 1 or args.grad_ckpt == "both"):
        # a second save of one process reads back as only what it added (compile_cache.save_compile_artifacts)
        parser.error("--compile_artifacts measures one row per process: pass one model and one variant")
    for spec in args.variants:
        try:
            parse_variant(spec)
        except ValueError as err:
            parser.error(str(err))
    if args.compile_mode == "reduce-overhead" and args.compile == "layers" and args.grad_ckpt != "off":
        # Checkpoint recompute re-runs each compiled layer inside backward, whose replay overwrites the CUDA-graph
        # outputs the first run still needs (H100: RuntimeError in every +compile row). examples/train_clip.py,
        # which compiles the whole model, trains with both (2026-11-23).
        parser.error(
            "--compile_mode reduce-overhead with --grad_ckpt on/both needs --compile model (per-layer CUDA "
            "graphs are overwritten by the checkpoint recompute)"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU (or --device cpu --tiny for a smoke test)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(args)


if __name__ == "__main__":
    main()
