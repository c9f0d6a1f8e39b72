"""SwitchBackConfig: which SwitchBack variant to use and which linears get it.

Config is data: a frozen dataclass, validated on construction so a bad value fails where it is written,
not deep inside a kernel during the first training step.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from .kernels.options import KernelOptions
from .kernels.wgrad import WGRAD_PRECISIONS

WEIGHT_SCALINGS = ("tensor", "row")
PRECISIONS = ("int8", "fp8")
BACKENDS = ("auto", "triton", "torch")
FP8_GRAD_FORMATS = ("e4m3", "e5m2")
GRAD_PRECISIONS = ("auto", "int8", "fp8")
# The name transformers files this method under: config.json's quantization_config.quant_method.
QUANT_METHOD = "switchback"

# Every linear inside the text and vision transformer layers of CLIP and SigLIP (HF module names).
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
# The projections into the joint embedding space are small and sit right before the contrastive logits,
# where quantization noise costs the most accuracy for the least speed: keep them 16-bit, as the paper does.
# SigLIP's equivalents are its heads: the text tower's `head` linear (not a target: its name is none of the
# above) and the vision tower's attention-pool head (`head.attention`, an nn.MultiheadAttention that is never a
# target, then `head.mlp`, excluded here). The pool head runs on one probe token per image, so 8-bit saves nothing
# measurable there, and its output is the image embedding. Ask for them by naming them in target_modules and
# leaving them out of exclude_modules.
DEFAULT_EXCLUDE_MODULES = ("visual_projection", "text_projection", "head.mlp.fc1", "head.mlp.fc2")


def _as_target(value: str | list[str] | tuple[str, ...] | None, field_name: str):
    """Normalize a PEFT-style target spec: str stays a regex, sequences become tuples of names."""
    if value is None:
        return value
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(
                f"SwitchBackConfig.{field_name}: {value!r} is not a valid regex ({err})"
            ) from None
        problem = _backtracking_risk(value)
        if problem:
            raise ValueError(
                f"SwitchBackConfig.{field_name}: regex {value!r} has {problem}, which can take exponential time "
                "to match (a config.json is untrusted input); use a list of module names / dotted suffixes, "
                "or a regex without repeats inside repeated groups"
            )
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        names = tuple(value)
        bad = [n for n in names if not isinstance(n, str) or not n]
        if bad:
            raise ValueError(
                f"SwitchBackConfig.{field_name}: every entry must be a non-empty str, got {bad!r}"
            )
        return names
    raise TypeError(
        f"SwitchBackConfig.{field_name} must be a str (regex, full match), a list of module names / dotted "
        f"suffixes, or None; got {type(value).__name__}"
    )


def _backtracking_risk(pattern: str) -> str | None:
    """What makes `pattern` prone to catastrophic backtracking, or None when it is simple.

    Target regexes come from config.json too (`from_pretrained` reads quantization_config), and Python's
    `re` has no time limit: `([a-z_.0-9]+)+Z` against a 60-character module name backtracks for minutes.
    The exponential cases need a repeat (or an alternation, `(a|ab)*`) inside another unbounded repeat, or a
    back-reference; those are refused. Optional groups (`(.*\\.)?fc1`) and repeats side by side are fine.
    """
    try:
        from re import _constants as c  # Python >= 3.11
        from re import _parser as parser
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_constants as c
        import sre_parse as parser

    repeats = {c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT)}

    def walk(items, in_repeat: bool) -> str | None:
        for op, av in items:
            if op in repeats:
                _low, high, body = av
                if in_repeat:
                    return "a repeat inside a repeated group (nested quantifiers)"
                found = walk(body, high > 1)
            elif op is c.BRANCH:
                if in_repeat:
                    return "an alternation inside a repeated group"
                found = next((r for r in (walk(alt, False) for alt in av[1]) if r), None)
            elif op in (c.GROUPREF, c.GROUPREF_EXISTS):
                return "a back-reference"
            elif op is c.SUBPATTERN:
                found = walk(av[-1], in_repeat)
            elif op in (c.ASSERT, c.ASSERT_NOT):
                found = walk(av[1], in_repeat)
            elif op is getattr(c, "ATOMIC_GROUP", None):
                found = walk(av, in_repeat)
            else:
                continue
            if found:
                return found
        return None

    return walk(parser.parse(pattern), False)


@dataclass(frozen=True)
class SwitchBackConfig:
    """How to quantize. Field names are part of the public API (docs, tests, config.json use them).

    It is also what transformers holds as the model's quantization config: transformers only reads
    `quant_method` and calls `to_dict()` on it, and `hf_switchback.quantizer` registers a loader that turns
    config.json's dict back into this class. So the same object goes to apply_switchback and to
    `from_pretrained(..., quantization_config=...)`.
    """

    # Not a field: transformers reads it to pick the quantizer; to_dict writes it to config.json.
    quant_method: ClassVar[str] = QUANT_METHOD

    # "tensor": one scale for the whole weight (bitsandbytes' SwitchBackLinearGlobal): cheapest to quantize.
    # "row": one scale per output channel in forward and per input channel for the transposed weight in
    # grad-input (SwitchBackLinearVectorwise): tighter scales, more robust to outlier channels.
    weight_scaling: str = "tensor"
    # The memory switch. Save each swapped linear's input in 8 bits (+ its row scales) for backward instead of
    # 16 bits, and (through fuse_mlp's default) run each CLIP MLP fused, recomputing its fc1 output in
    # backward. Numerics: grad-weight is computed from the dequantized 8-bit input (8-bit-accurate dW);
    # forward and grad-input are unchanged. A vision layer's saved activations about halve, so batches fit
    # without recompute where bf16 + compile needs checkpointing or an activation budget (BENCHMARKS.md, Memory).
    memory_efficient: bool = False
    # Forward format. "int8": symmetric absmax int8 (the paper). "fp8": e4m3. Gradients: see grad_precision.
    precision: str = "int8"
    # Whenever gradients are fp8 (see grad_precision): format of both grad-input operands (the output gradient and the transposed weight; one GEMM
    # dtype keeps the kernel simple). e4m3 keeps 3 mantissa bits and suffices with a
    # per-row scale (the scale handles range); e5m2 trades a mantissa bit for range.
    fp8_grad_format: str = "e4m3"
    # Format of the grad-input GEMM operands (the output gradient and the transposed weight). "auto": fp8
    # (`fp8_grad_format`) on GPUs with fp8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell) and
    # whenever precision="fp8"; int8 elsewhere (Ampere, CPU). Row-wise int8 rounds every entry below absmax/254
    # of a gradient row to zero (a sizeable share of them when training from scratch), fp8 keeps them. Both are
    # at parity with bf16 on the graded-shapes parity runs, while all-int8 fell behind on the ViT-B/16 default
    # task (BENCHMARKS.md, Accuracy). "int8" forces the paper's all-int8 SwitchBack.
    grad_precision: str = "auto"
    # Format of the weight-gradient GEMM dW = Gᵀ X, whose reduction runs over all batch x tokens. "16bit": the
    # paper's choice (SwitchBack "switches back" here). "fp8", opt-in beyond the paper: e5m2 output gradient
    # and e4m3 input, one scale per feature over all tokens, float32 accumulation, dW in the weight's dtype,
    # bias gradient still exact (kernels/wgrad.py); with memory_efficient the saved 8-bit input is dequantized
    # and re-quantized per feature. Needs fp8 tensor cores on CUDA (sm89+; other GPUs get an error at the
    # first forward); the CPU runs the torch reference. Accuracy against bf16 is not yet established
    # (README, Configuration), so it stays off by default.
    wgrad_precision: str = "16bit"
    # Which linears to swap. str: regex full match on the dotted module name, refused when it could backtrack
    # exponentially (nested repeats, see _backtracking_risk). list: exact names or dotted suffixes (PEFT
    # semantics). None: the CLIP / SigLIP encoder defaults above. An nn.MultiheadAttention whose own name matches
    # (OpenCLIP's "attn") runs its projections in SwitchBack too (blocks/multihead_attention.py).
    target_modules: str | tuple[str, ...] | None = DEFAULT_TARGET_MODULES
    # Same matching rules; wins over target_modules.
    exclude_modules: str | tuple[str, ...] | None = DEFAULT_EXCLUDE_MODULES
    # "auto": triton when CUDA and triton are usable, else torch (logged once). "triton": require the GPU
    # kernels (error at apply time if absent). "torch": the reference path (CPU, or GPU for debugging).
    backend: str = "auto"
    # Batches with fewer rows (tokens) than this run the plain 16-bit matmul: at small sizes the quantize
    # passes and launches cost more than the 8-bit GEMM saves. None = automatic, for CUDA tensors under
    # backend="auto": each layer's measured crossover for its (in, out) shape and precision on this GPU
    # (kernels/crossover; a shape whose 8-bit path never paid stays 16-bit), 16384 where the GPU has no table
    # or the shape no close family, and with memory_efficient (whose 8-bit saved inputs are the point);
    # 0 elsewhere. 0 = always quantize.
    min_tokens: int | None = None
    # When fc1 and fc2 of a transformers CLIPMLP are both converted with this config, run the block
    # fc1 -> activation -> fc2 as one fused SwitchBack op (hf_switchback.blocks.mlp): the activation runs inside
    # the 8-bit quantize passes and its output is recomputed in backward instead of saved, so the block saves
    # only fc1's input and output (half of bf16's activations); with memory_efficient only fc1's 8-bit input,
    # fc1's output being recomputed in backward by one more 8-bit GEMM (bit-identical). Supported
    # activations: gelu (erf), the tanh approximations and quick_gelu; other blocks keep the separate layers.
    # None (default): on with memory_efficient, off otherwise. With the LayerNorm and activation producers of
    # the separate layers (fuse_norm, fuse_activation) both make the same compiled step (ViT-H/14 b192: 483.5 vs
    # 482.8 ms), and the fused block saves 16-19% of peak memory (77.0 vs 92.1 GiB), enough to fit an 80 GB GPU
    # where the separate layers do not (BENCHMARKS.md, The speed targets); it stays opt-in until measured on the
    # smaller models. True / False force it either way.
    fuse_mlp: bool | None = None
    # When q_proj, k_proj and v_proj of a transformers CLIP / SigLIP attention block are all converted with
    # this config, compute them as one op (hf_switchback.blocks.attention): their shared input is quantized once
    # and one N = 3d 8-bit GEMM runs forward (each projection keeps its own weight scale: forward outputs equal
    # the separate layers' bit for bit on the reference path); backward quantizes the three output gradients as
    # one (tokens, 3d) operand for one grad-input GEMM, so each token row shares one gradient scale across q, k
    # and v (grad-input within the separate layers' own 8-bit error, not bit-identical), and runs one 16-bit
    # grad-weight GEMM for all three. Off by default until measured faster end to end.
    fuse_qkv: bool = False
    # Quantize in the producer: in a transformers CLIP / SigLIP encoder layer, the LayerNorm before fc1 (fc1
    # converted with this config, the MLP fused or not; with the residual add before it in the same kernel)
    # and the one before q/k/v (one op with fuse_qkv, else the three layers, which read one 8-bit form and whose
    # gradients are summed in the LayerNorm's input dtype as in the stock graph) also write that op's row-wise
    # 8-bit input (blocks/encoder_layer.py), so no separate quantize pass reads their output; out_proj's 8-bit
    # input comes from our one-pass kernel, also under torch.compile (blocks/attention.py). Numerics: the
    # unfused add -> LayerNorm -> quantize pipeline's, y computed in float32 and rounded once to the linear's
    # input dtype (kernels/reference.py states it; the Triton kernel sums in another order, within one rounding
    # of y).
    # On by default: faster under torch.compile and in eager mode (BENCHMARKS.md, Whole training step), for ~4%
    # more peak memory without memory_efficient (the LayerNorm's 16-bit output is saved for fc1's weight gradient,
    # where a compiled stock block recomputes it).
    fuse_norm: bool = True
    # Quantize in the producer, in the MLP: where fc1 and fc2 of a transformers CLIP / SigLIP MLP run as separate
    # SwitchBack layers (fuse_mlp off) with this config, the activation between them runs as one kernel that
    # writes act(fc1's output) in 16 bits (fc2's grad-weight GEMM reads it) and fc2's row-wise 8-bit input (blocks/mlp.py),
    # instead of the activation then fc2's own quantize pass. Numerics: the unfused pipeline's (act in float32,
    # rounded once to the 16-bit dtype, that rounding quantized). Where fc1 runs 8-bit too, fc1 and the activation
    # are one backward node whose activation backward also writes fc1's 8-bit output gradient and bias gradient
    # (blocks/linear_activation.py; the derivative of kernels/reference.activation_backward, float32, rounded
    # once). On by default, as fuse_norm.
    fuse_activation: bool = True
    # How the GPU kernels run (kernels/options.py): implementation choices with the same numerics, so a
    # run-time choice rather than part of the model. Not written to config.json (to_dict leaves it out) and not
    # compared (two configs that differ only here are the same quantization). Each layer carries its own, so
    # two models in one process may differ. Defaults: the measured winners, see KernelOptions.
    kernel_options: KernelOptions = dataclasses.field(default_factory=KernelOptions, compare=False)

    def __post_init__(self) -> None:
        _check_choice("weight_scaling", self.weight_scaling, WEIGHT_SCALINGS)
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("fp8_grad_format", self.fp8_grad_format, FP8_GRAD_FORMATS)
        _check_choice("grad_precision", self.grad_precision, GRAD_PRECISIONS)
        _check_choice("wgrad_precision", self.wgrad_precision, WGRAD_PRECISIONS)
        if self.precision == "fp8" and self.grad_precision == "int8":
            raise ValueError(
                "SwitchBackConfig(precision='fp8', grad_precision='int8') is not supported: int8 gradients lose "
                "accuracy that fp8 keeps. Use grad_precision='auto' (or 'fp8')."
            )
        if not isinstance(self.memory_efficient, bool):
            raise TypeError(
                f"SwitchBackConfig.memory_efficient must be a bool, got {type(self.memory_efficient).__name__}"
            )
        if self.fuse_mlp is not None and not isinstance(self.fuse_mlp, bool):
            raise TypeError(
                f"SwitchBackConfig.fuse_mlp must be None (follow memory_efficient) or a bool, got "
                f"{type(self.fuse_mlp).__name__}"
            )
        if not isinstance(self.fuse_qkv, bool):
            raise TypeError(f"SwitchBackConfig.fuse_qkv must be a bool, got {type(self.fuse_qkv).__name__}")
        for name in ("fuse_norm", "fuse_activation"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"SwitchBackConfig.{name} must be a bool, got {type(getattr(self, name)).__name__}"
                )
        if not isinstance(self.kernel_options, KernelOptions):
            raise TypeError(
                "SwitchBackConfig.kernel_options must be a hf_switchback.KernelOptions, got "
                f"{type(self.kernel_options).__name__}"
            )
        bad_int = not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool)
        if self.min_tokens is not None and (bad_int or self.min_tokens < 0):
            raise ValueError(
                f"SwitchBackConfig.min_tokens must be None (automatic) or an int >= 0, got {self.min_tokens!r}"
            )
        object.__setattr__(self, "target_modules", _as_target(self.target_modules, "target_modules"))
        object.__setattr__(self, "exclude_modules", _as_target(self.exclude_modules, "exclude_modules"))
        if self.target_modules is None:
            object.__setattr__(self, "target_modules", DEFAULT_TARGET_MODULES)

    @property
    def fuses_mlp(self) -> bool:
        """fuse_mlp with None resolved: whether CLIP MLPs converted with this config run fused."""
        return self.memory_efficient if self.fuse_mlp is None else self.fuse_mlp

    @property
    def variant(self) -> str:
        """Short human name, e.g. 'int8/tensor/mem-efficient' (used in repr and logs)."""
        name = f"{self.precision}/{self.weight_scaling}"
        if self.grad_precision != "auto":  # explicit: int8 and "auto" differ on fp8-capable GPUs
            name += f"/{self.grad_precision}-grad"
        if self.wgrad_precision != "16bit":
            name += f"/{self.wgrad_precision}-wgrad"
        return name + ("/mem-efficient" if self.memory_efficient else "")

    def replace(self, **changes: Any) -> SwitchBackConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples become lists), plus quant_method="switchback" for config.json.

        kernel_options is left out: it is how this process runs the kernels, not what the checkpoint is.
        """
        out: dict[str, Any] = {"quant_method": QUANT_METHOD}
        for f in dataclasses.fields(self):
            if f.name in _RUNTIME_FIELDS:
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SwitchBackConfig:
        """Inverse of to_dict. Unknown keys are an error (a typo must not silently select a default).

        quant_method is optional, and must be "switchback" when present (the config.json form). kernel_options
        (never in to_dict's output) may be given as a KernelOptions or a dict of its fields.
        """
        data = dict(data)
        method = data.pop("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            raise ValueError(
                f"SwitchBackConfig.from_dict: quant_method must be {QUANT_METHOD!r}, got {method!r}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"SwitchBackConfig.from_dict: unknown keys {unknown}; known keys are {sorted(known)}"
            )
        if isinstance(data.get("kernel_options"), dict):
            data["kernel_options"] = KernelOptions(**data["kernel_options"])
        return cls(**data)


# Fields to_dict leaves out of config.json: choices of this process, not of the checkpoint.
_RUNTIME_FIELDS = ("kernel_options",)


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"SwitchBackConfig.{name} must be one of {allowed}, got {value!r}")


__all__ = [
    "DEFAULT_EXCLUDE_MODULES",
    "DEFAULT_TARGET_MODULES",
    "QUANT_METHOD",
    "KernelOptions",
    "SwitchBackConfig",
]
