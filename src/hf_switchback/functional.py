"""SwitchBack autograd: 8-bit forward and grad-input, 16-bit grad-weight.

    forward     Y  = X Wᵀ + b   X row-wise, W tensor- or row-wise quantized; 8-bit GEMM, fused dequantize
    grad-input  dX = G W        G row-wise, Wᵀ quantized like W in forward; 8-bit GEMM
    grad-weight dW = Gᵀ X       16-bit: its inner dimension is batch x tokens, where 8-bit noise would grow
                                with the sum (the paper's reason to "switch back")
                                config.wgrad_precision="fp8" runs it in fp8 instead, opt-in (kernels/wgrad.py)

The kernels come from `kernels.backends.get_kernels`, so this file holds no arithmetic of its own.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F

from .config import SwitchBackConfig
from .kernels import crossover, graph_leaf
from .kernels.backends import KernelSet, get_kernels
from .kernels.cublas import has_fp8_tensor_cores
from .kernels.options import KernelOptions
from .kernels.reference import ACTIVATIONS, apply_activation
from .kernels.wgrad import RowQuantized, check_device, weight_grad

graph_leaf.argument_class(SwitchBackConfig)  # the whole-call leaves below take the config

FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# min_tokens=None (automatic) with backend="auto" on CUDA, where no measured per-shape crossover applies
# (kernels/crossover): below this many rows (tokens) the 16-bit matmul is used. At small M the 8-bit GEMMs
# cannot amortize the quantize passes and launches (measured on H100, BENCHMARKS.md, MLP block). An explicit
# config.min_tokens replaces it on any backend.
AUTO_MIN_TOKENS_CUDA = crossover.FALLBACK_MIN_TOKENS


def grad_precision(config: SwitchBackConfig, device: torch.device | None = None) -> str:
    """config.grad_precision with "auto" resolved for tensors on `device` (None: not a CUDA device)."""
    if config.grad_precision != "auto":
        return config.grad_precision
    if config.precision == "fp8":
        return "fp8"
    if device is None or device.type != "cuda":
        return "int8"
    # a bare "cuda" device means the current one (a rank's own GPU), not GPU 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return "fp8" if has_fp8_tensor_cores(index) else "int8"


def quantized_dtypes(
    config: SwitchBackConfig, device: torch.device | None = None
) -> tuple[torch.dtype, torch.dtype]:
    """(forward operand dtype, output-gradient operand dtype) for a config and the device of its tensors."""
    forward = torch.int8 if config.precision == "int8" else torch.float8_e4m3fn
    grad = torch.int8 if grad_precision(config, device) == "int8" else FP8_FORMATS[config.fp8_grad_format]
    return forward, grad


def quantize_weight(
    kernels: KernelSet,
    weight: torch.Tensor,
    weight_scaling: str,
    qdtype: torch.dtype,
    options: KernelOptions | None = None,
    transposed: bool = False,
):
    """A weight operand, (N, K) -> the forward GEMM's (q (N, K), scale () for "tensor" or (N,) for "row"), or
    with transposed the grad-input GEMM's (q (K, N), scale () or (K,))."""
    if weight_scaling == "tensor":
        quantize = kernels.quantize_tensorwise_transposed if transposed else kernels.quantize_tensorwise
    else:
        quantize = kernels.quantize_rowwise_transposed if transposed else kernels.quantize_rowwise
    return quantize(weight, qdtype, options=options)


# The last quantized layer input, for the next call with the same input tensor: q, k and v of an attention
# layer receive one tensor, so in eager mode it is quantized once and one 8-bit copy is saved for all three
# (torch.compile merges the three quantizes itself). "entry": (weak reference to the caller's input tensor,
# its version counter then, key, slot); the slot list holds [x_q, x_scale] once computed. The entry goes when
# that tensor is freed, so the cache keeps nothing alive past its input.
_SHARED_INPUT: dict = {}


def _drop_shared(ref) -> None:
    entry = _SHARED_INPUT.get("entry")
    if entry is not None and entry[0] is ref:
        del _SHARED_INPUT["entry"]


def _shared_input_slot(x: torch.Tensor, key: tuple) -> list | None:
    """The slot for quantizing `x` (the caller's tensor) under `key`: [x_q, x_scale] when an earlier call filled
    it, [] to fill, None where no sharing applies (while compiling; inference tensors have no version)."""
    if graph_leaf.compiling() or x.is_inference():
        return None
    entry = _SHARED_INPUT.get("entry")
    if entry is not None and entry[0]() is x and entry[1] == x._version and entry[2] == key:
        return entry[3]
    slot: list = []
    _SHARED_INPUT["entry"] = (weakref.ref(x, _drop_shared), x._version, key, slot)
    return slot


def _autocast_off(device_type: str):
    """Autocast off for the 8-bit path (its dtypes are chosen here), or no context where autocast is off
    already: an empty autocast region still adds enter / exit calls to a compiled graph, and torch's AOT autograd
    cache refuses graphs with those (torch 2.13). The ops call it inside their graph leaf (kernels/graph_leaf.py)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class _SwitchBackLinearFn(torch.autograd.Function):
    """2-D core. x (M, K) and out (M, N) share a float dtype; weight (N, K) and bias (N,) any float dtype.
    `spec`: the constant arguments, one tuple (weight_scaling, memory_efficient, forward qdtype, gradient
    qdtype, backend, KernelOptions, wgrad = config.wgrad_precision, the format of the grad-weight GEMM in
    kernels/wgrad.py). One argument, not seven: `apply` checks each argument for tensors, in eager mode per call.
    `shared`: None, or a slot of _shared_input_slot holding (or to hold) x's 8-bit form.
    x_q, x_scale: x's 8-bit form when its producer wrote it (the LayerNorm before q/k/v or fc1), else None.
    weight_operands: the weight's cached 8-bit forms (w_q, w_scale, wt_q, wt_scale; weight_operands.py), else
    None: the weight is quantized here and, transposed, again in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec, shared=None, x_q=None, x_scale=None, weight_operands=None):
        weight_scaling, memory_efficient, fwd_qdtype, _, backend, options, _ = spec
        kernels = get_kernels(backend, x.device, options)
        if x_q is None and shared:
            x_q, x_scale = shared
        elif x_q is None:
            x_q, x_scale = kernels.quantize_rowwise(x, fwd_qdtype, options=options)
            if shared is not None:
                shared[:] = [x_q, x_scale]
        if weight_operands is None:
            w_q, w_scale = quantize_weight(kernels, weight, weight_scaling, fwd_qdtype, options)
            weight_t = ()  # backward re-quantizes W transposed rather than keeping a second copy alive
        else:
            w_q, w_scale, *weight_t = weight_operands
        out = kernels.scaled_matmul(x_q, w_q, x_scale, w_scale, bias, x.dtype, options=options)

        if memory_efficient:
            ctx.save_for_backward(x_q, x_scale, weight, *weight_t)
        else:
            ctx.save_for_backward(x, weight, *weight_t)
        ctx.config = (spec, x.dtype, None if bias is None else bias.dtype)
        ctx.kernels = kernels  # backward runs the forward's set (kernels/graph_leaf.py says why)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        spec, x_dtype, bias_dtype = ctx.config
        needs = ctx.needs_input_grad[:3]
        saved = ctx.saved_tensors
        kept = 3 if spec[1] else 2  # (x_q, x_scale, weight) with memory_efficient, else (x, weight)
        weight_t = saved[kept:] or None
        grads = linear_grads(
            spec, x_dtype, bias_dtype, needs, saved[:kept], grad_out, kernels=ctx.kernels, weight_t=weight_t
        )
        return *grads, None, None, None, None, None


@graph_leaf.op("switchback_linear")
def _linear_op(x, weight, bias, spec, shared, x_q, x_scale, weight_operands):
    # autocast off inside the op: under torch.compile Dynamo's graph then holds no autocast region (AOT autograd's
    # cache refuses one on torch 2.13)
    with _autocast_off(x.device.type):
        return _SwitchBackLinearFn.apply(x, weight, bias, spec, shared, x_q, x_scale, weight_operands)


def linear_spec(config: SwitchBackConfig, fwd_qdtype: torch.dtype, grad_qdtype: torch.dtype) -> tuple:
    """The constant arguments of a SwitchBack linear's autograd op as one tuple (see _SwitchBackLinearFn)."""
    return (
        config.weight_scaling,
        config.memory_efficient,
        fwd_qdtype,
        grad_qdtype,
        config.backend,
        config.kernel_options,
        config.wgrad_precision,
    )


def linear_grads(
    spec: tuple,
    x_dtype: torch.dtype,
    bias_dtype: torch.dtype | None,
    needs_input_grad: tuple[bool, bool, bool],
    saved: tuple[torch.Tensor, ...],
    grad_out: torch.Tensor,
    quantized_grad: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kernels: KernelSet | None = None,
    weight_t: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(grad_x, grad_w, grad_b) of a SwitchBack linear from its output gradient (M, N).

    saved: what its forward saved, (x, weight), or (x_q, x_scale, weight) with memory_efficient.
    quantized_grad: grad_out's row-wise 8-bit form and float32 column sum (g_q, g_scale, g_colsum) when the
    kernel that produced grad_out wrote them (the activation backward before fc1), else None.
    kernels: the kernel set the forward ran (None: the one for grad_out's device now).
    weight_t: the weight's cached transposed 8-bit form (wt_q (K, N), wt_scale), else None (quantized here).
    """
    weight_scaling, memory_efficient, _, grad_qdtype, backend, options, wgrad = spec
    if memory_efficient:
        x_q, x_scale, weight = saved
    else:
        x, weight = saved
    if kernels is None:
        kernels = get_kernels(backend, grad_out.device, options)
    grad_out = grad_out.contiguous()
    grad_x = grad_w = grad_b = g_colsum = None
    needs_grad_b = bias_dtype is not None and needs_input_grad[2]

    if needs_input_grad[0]:
        if quantized_grad is not None:
            g_q, g_scale, g_colsum = quantized_grad
        elif needs_grad_b and options.fused_bias_grad:
            # One pass over grad_out yields its 8-bit form and the bias gradient (column sum).
            g_q, g_scale, g_colsum = kernels.quantize_rowwise_colsum(grad_out, grad_qdtype, options=options)
        else:
            g_q, g_scale = kernels.quantize_rowwise(grad_out, grad_qdtype, options=options)
        if weight_t is not None:
            wt_q, wt_scale = weight_t
        else:
            wt_q, wt_scale = quantize_weight(
                kernels, weight, weight_scaling, grad_qdtype, options, transposed=True
            )
        grad_x = kernels.scaled_matmul(g_q, wt_q, g_scale, wt_scale, None, x_dtype, options=options)
    elif quantized_grad is not None:
        g_colsum = quantized_grad[2]

    if needs_input_grad[1]:
        if memory_efficient:
            x = RowQuantized(x_q, x_scale, x_dtype)
        grad_w = weight_grad(grad_out, x, weight.dtype, wgrad, kernels, options)

    if needs_grad_b:
        if g_colsum is None:
            g_colsum = grad_out.sum(dim=0, dtype=torch.float32)
        grad_b = g_colsum.to(bias_dtype)

    return grad_x, grad_w, grad_b


class _SwitchBackMLPFn(torch.autograd.Function):
    """fc1 -> act -> fc2 as one node. x (M, d); w1 (4d, d), b1; w2 (d, 4d), b2; out (M, d) in x's dtype.

    Forward: the activation runs inside fc2's input quantize (h read once, act(h) never written).
    Saved: x and h = fc1's output. Not act(h): backward recomputes it inside the activation-backward pass,
    which reads h anyway, so it costs a write there instead of one in forward (same bytes) and saves a (M, 4d)
    16-bit tensor for the whole time between forward and backward.
    memory_efficient: only x's 8-bit form (+ row scales) is saved; backward recomputes h from it with fc1's
    8-bit GEMM, the same operands as forward, so h is bit-identical (no numerics cost beyond dW1 from the 8-bit
    x): one more (M, d) x (d, 4d) 8-bit GEMM per block in exchange for the block's largest saved tensor.
    Backward: act' runs inside the quantize + column sum of fc1's output gradient.
    `spec`: the constant arguments as one tuple, as in _SwitchBackLinearFn, the activation first; x_q, x_scale
    as there.
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, spec, x_q=None, x_scale=None, operands1=None, operands2=None):
        activation, weight_scaling, memory_efficient, fq, _, backend, options, _ = spec
        kernels = get_kernels(backend, x.device, options)
        if x_q is None:
            x_q, x_scale = kernels.quantize_rowwise(x, fq, options=options)
        if operands1 is None:
            w1_q, w1_scale = quantize_weight(kernels, w1, weight_scaling, fq, options)
        else:
            w1_q, w1_scale = operands1[:2]
        h = kernels.scaled_matmul(x_q, w1_q, x_scale, w1_scale, b1, x.dtype, options=options)
        del w1_q
        a_q, a_scale = kernels.act_quantize_rowwise(h, fq, activation, options=options)
        if operands2 is None:
            w2_q, w2_scale = quantize_weight(kernels, w2, weight_scaling, fq, options)
        else:
            w2_q, w2_scale = operands2[:2]
        out = kernels.scaled_matmul(a_q, w2_q, a_scale, w2_scale, b2, x.dtype, options=options)
        # the cached operands backward reads: fc1's forward form (memory_efficient recomputes h) and both
        # transposed forms, or nothing (quantized there)
        cached = () if operands1 is None or operands2 is None else (*operands1, *operands2[2:])
        if memory_efficient:
            del h  # recomputed in backward from x_q (see the class docstring)
            ctx.save_for_backward(x_q, x_scale, w1, b1, w2, *cached)
        else:
            ctx.save_for_backward(x, h, w1, w2, *cached)
        ctx.config = (spec, x.dtype, None if b1 is None else b1.dtype, None if b2 is None else b2.dtype)
        ctx.kernels = kernels  # as in _SwitchBackLinearFn
        return out

    @staticmethod
    def backward(ctx, grad_out):
        spec, x_dtype, b1_dtype, b2_dtype = ctx.config
        activation, weight_scaling, memory_efficient, _, gq, _, options, wgrad = spec
        kernels = ctx.kernels
        saved = ctx.saved_tensors
        kept = 5 if memory_efficient else 4
        cached = saved[kept:]  # (w1_q, w1_scale, w1t_q, w1t_scale, w2t_q, w2t_scale) or ()
        if memory_efficient:
            x_q, x_scale, w1, b1, w2 = saved[:kept]
            if cached:
                w1_q, w1_scale = cached[:2]
            else:
                w1_q, w1_scale = quantize_weight(kernels, w1, weight_scaling, x_q.dtype, options)
            h = kernels.scaled_matmul_recompute(x_q, w1_q, x_scale, w1_scale, b1, x_dtype, options=options)
            del w1_q
        else:
            x, h, w1, w2 = saved[:kept]
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        need_b1 = need_b1 and b1_dtype is not None
        need_b2 = need_b2 and b2_dtype is not None
        need_fc1 = need_x or need_w1 or need_b1
        g = grad_out.contiguous()
        grad_x = grad_w1 = grad_b1 = grad_w2 = grad_b2 = None

        a = None
        if need_fc1:
            g_q, g_scale, g_colsum = kernels.quantize_rowwise_colsum(g, gq, options=options)
            w2t_q, w2t_scale = (
                cached[4:]
                if cached
                else quantize_weight(kernels, w2, weight_scaling, gq, options, transposed=True)
            )
            # grad_h = (G W2) * act'(h), the GEMM then the activation backward + quantize in one call.
            grad_h, a, gh_q, gh_scale, gh_colsum = kernels.scaled_matmul_act_backward(
                g_q, w2t_q, g_scale, w2t_scale, h, gq, activation, need_w2, options=options
            )
            del g_q, w2t_q
            if need_b2:
                grad_b2 = g_colsum.to(b2_dtype)
        elif need_w2:
            a = apply_activation(h, activation)  # only fc2's weight needs a gradient: rare, unfused
        if need_b2 and grad_b2 is None:
            grad_b2 = g.sum(dim=0, dtype=torch.float32).to(b2_dtype)
        if need_w2:
            grad_w2 = weight_grad(g, a, w2.dtype, wgrad, kernels, options)
        del a

        if need_x:
            w1t_q, w1t_scale = (
                cached[2:4]
                if cached
                else quantize_weight(kernels, w1, weight_scaling, gq, options, transposed=True)
            )
            grad_x = kernels.scaled_matmul(gh_q, w1t_q, gh_scale, w1t_scale, None, x_dtype, options=options)
        if need_w1:
            if memory_efficient:
                x = RowQuantized(x_q, x_scale, x_dtype)
            grad_w1 = weight_grad(grad_h, x, w1.dtype, wgrad, kernels, options)
        if need_b1:
            grad_b1 = gh_colsum.to(b1_dtype)
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None, None, None


@graph_leaf.op("switchback_mlp")
def _mlp_op(x, w1, b1, w2, b2, spec, x_q, x_scale, operands1, operands2):
    with _autocast_off(x.device.type):  # as in _linear_op
        return _SwitchBackMLPFn.apply(x, w1, b1, w2, b2, spec, x_q, x_scale, operands1, operands2)


def check_quantized_input(name: str, quantized_input, x2d: torch.Tensor, qdtype: torch.dtype) -> tuple:
    """(x_q, x_scale) from an op's `quantized_input` argument, checked against x as the op quantizes it."""
    if quantized_input is None:
        return None, None
    x_q, x_scale = quantized_input
    if x_q.shape != x2d.shape or x_q.dtype != qdtype or x_scale.shape != (x2d.shape[0],):
        raise ValueError(
            f"{name}: quantized_input must be x's row-wise 8-bit form, q {tuple(x2d.shape)} {qdtype} and scale "
            f"({x2d.shape[0]},) float32, got q {tuple(x_q.shape)} {x_q.dtype} and scale {tuple(x_scale.shape)}"
        )
    return x_q.contiguous(), x_scale


def check_weight_operands(name: str, operands, weight: torch.Tensor, qdtypes: tuple[torch.dtype, ...]):
    """`operands` (w_q, w_scale, wt_q, wt_scale) as a layer's WeightOperands keeps them for `weight` (N, K) in
    the (forward, gradient) formats `qdtypes`, else a RuntimeError (operands of another layer or config)."""
    if operands is None:
        return None
    n, k = weight.shape
    w_q, _, wt_q, _ = operands
    if w_q.shape != (n, k) or wt_q.shape != (k, n) or (w_q.dtype, wt_q.dtype) != qdtypes:
        raise RuntimeError(
            f"{name}: weight_operands hold {tuple(w_q.shape)} {w_q.dtype} and {tuple(wt_q.shape)} {wt_q.dtype} "
            f"for a ({n}, {k}) weight in {qdtypes[0]} / {qdtypes[1]}: pass the layer's own "
            "(weight_operands.operands_for(layer)), or None"
        )
    return operands


def check_input(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not x.is_floating_point() or x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"SwitchBack linear expects a floating-point input (float32, bfloat16, float16 or float64), got "
            f"{x.dtype}. "
            "Cast the input, e.g. x.float()."
        )
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        # The same message nn.Linear gives, so user code that handles one handles the other.
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 1
        cols = x.shape[-1] if x.dim() else 1
        raise RuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({rows}x{cols} and {weight.shape[1]}x{weight.shape[0]})"
        )


def token_floor(
    config: SwitchBackConfig,
    device: torch.device | str,
    *shapes: tuple[int, int],
    compiled: bool | None = None,
) -> int:
    """Rows below which the exact 16-bit matmul runs instead of SwitchBack (see config.min_tokens).

    shapes: the (K, N) = (in_features, out_features) of the linears the call runs in 8 bits (two for a fused
    MLP, which then needs both to pay). With min_tokens=None under backend="auto" on CUDA each shape's
    threshold is its measured crossover on this GPU (kernels/crossover; crossover.NEVER where 8-bit never
    paid), else AUTO_MIN_TOKENS_CUDA; no shapes, or memory_efficient (whose point is the memory, and which
    the tables do not measure), keep AUTO_MIN_TOKENS_CUDA. `compiled`: whether the thresholds measured under
    torch.compile apply (there the launches and the fused quantizes cost less); None: while torch.compile
    traces (graph_leaf.compiling(), inside a leaf too).
    """
    if config.min_tokens is not None:
        return config.min_tokens
    return token_floor_range(config, device, *shapes, compiled=compiled)[1]


def token_floor_range(
    config: SwitchBackConfig,
    device: torch.device | str,
    *shapes: tuple[int, int],
    compiled: bool | None = None,
) -> tuple[int, int]:
    """(lowest, highest) of the token floors of the linears of `shapes`, each on its own (token_floor says how
    one is chosen): below the lowest every one of them runs its exact 16-bit matmul, from the highest on every
    one runs 8-bit (a call over several of them, e.g. a fused MLP, needs the highest)."""
    if config.min_tokens is not None:
        return config.min_tokens, config.min_tokens
    if isinstance(device, str):
        device = torch.device(device)
    capability = crossover.cuda_capability(device.type, device.index) if config.backend == "auto" else None
    if capability is None:
        return 0, 0
    if not shapes or config.memory_efficient:
        return AUTO_MIN_TOKENS_CUDA, AUTO_MIN_TOKENS_CUDA
    if compiled is None:
        compiled = graph_leaf.compiling()
    return crossover.min_tokens_range(capability, shapes, config.precision, compiled)


def check_config(name: str, config) -> None:
    """Before a whole-call leaf: a graph node holds a SwitchBackConfig (graph_leaf marks it cacheable), not any
    object, so a wrong type fails here with its name, not inside torch.compile."""
    if config is not None and not isinstance(config, SwitchBackConfig):
        raise TypeError(f"{name}: config must be a SwitchBackConfig, got {type(config).__name__}")


def _flatten_input(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: SwitchBackConfig | None,
    shapes: tuple[tuple[int, int], ...],
) -> tuple[SwitchBackConfig, torch.Tensor, torch.Size, bool]:
    """Shared entry of the functional ops: (config, x as (M, K) in the compute dtype, leading shape,
    whether to run the exact 16-bit path because M is below the token floor of the (K, N) `shapes`)."""
    config = config or SwitchBackConfig()  # (its type checked by check_config before the leaf)
    check_input(x, weight)
    check_device(config.wgrad_precision, x.device)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        x = x.to(torch.get_autocast_dtype(device_type))
    x2d = x.reshape(-1, x.shape[-1])
    return config, x2d, x.shape[:-1], not runs_8bit(config, x, *shapes)


def runs_8bit(config: SwitchBackConfig, x: torch.Tensor, *shapes: tuple[int, int]) -> bool:
    """Whether a SwitchBack op over x (*, K) with the linears of (K, N) `shapes` runs its 8-bit path: at least
    one row, and no fewer rows than the token floor (else the exact 16-bit matmul runs)."""
    tokens = x.shape[:-1].numel()
    # (a set floor without calling token_floor: the blocks ask this at every forward, and each call is a frame
    # more for torch.compile's Dynamo to trace)
    floor = config.min_tokens
    if floor is None:
        floor = token_floor(config, x.device, *shapes)
    return tokens > 0 and tokens >= floor


def switchback_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SwitchBackConfig | None = None,
    *,
    quantized_input: tuple[torch.Tensor, torch.Tensor] | None = None,
    weight_operands: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """SwitchBack version of F.linear.

    x (*, K) float32/bfloat16/float16; weight (N, K); bias (N,) or None -> (*, N) in x's dtype, or in the
    autocast dtype when called under torch.autocast (as F.linear would).
    quantized_input: x's row-wise 8-bit form (q (tokens, K) in the config's forward format, scale (tokens,)
    float32) when its producer already wrote it (blocks/encoder_layer.py: the LayerNorm before the linear); the
    op then runs no quantize of its own. Ignored where the 16-bit path runs (below the token floor).
    weight_operands: the weight's 8-bit forms as its layer keeps them (weight_operands.operands_for), else
    None (the op quantizes the weight). Ignored where the 16-bit path runs.
    """
    if type(config) is not SwitchBackConfig:  # (no call in the usual case: a frame more for Dynamo to trace)
        check_config("switchback_linear", config)
    return graph_leaf.call(
        "switchback_linear_call", x, weight, bias, config, quantized_input, weight_operands
    )


# Under torch.compile the whole call is one leaf (kernels/graph_leaf.py): Dynamo records it without interpreting
# the checks and the choice of path below (about 500 of its bytecode steps per linear, every process, the warm
# start too), and AOT autograd traces them in plain Python. In eager mode graph_leaf.call runs it directly.
@graph_leaf.op("switchback_linear_call")
def _switchback_linear(x, weight, bias, config, quantized_input, weight_operands):
    shape = (weight.shape[1], weight.shape[0])
    config, x2d, leading, exact = _flatten_input(x, weight, config, (shape,))
    device_type = x2d.device.type
    if exact:
        # Small batches: quantization overhead exceeds the 8-bit speed-up; the 16-bit matmul is exact.
        with _autocast_off(device_type):
            w = weight.to(x2d.dtype)
            out = F.linear(x2d, w, None if bias is None else bias.to(x2d.dtype))
        return out.reshape(*leading, weight.shape[0])

    fwd_qdtype, grad_qdtype = quantized_dtypes(config, x2d.device)
    x_q, x_scale = check_quantized_input("switchback_linear", quantized_input, x2d, fwd_qdtype)
    shared = (
        None if x_q is not None else _shared_input_slot(x, (fwd_qdtype, config.backend, x2d.dtype, x2d.shape))
    )
    spec = linear_spec(config, fwd_qdtype, grad_qdtype)
    operands = check_weight_operands("switchback_linear", weight_operands, weight, (fwd_qdtype, grad_qdtype))
    out = graph_leaf.call(
        "switchback_linear", x2d.contiguous(), weight, bias, spec, shared, x_q, x_scale, operands
    )
    return out.reshape(*leading, weight.shape[0])


def switchback_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    activation: str,
    config: SwitchBackConfig | None = None,
    *,
    quantized_input: tuple[torch.Tensor, torch.Tensor] | None = None,
    weight_operands: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None,
) -> torch.Tensor:
    """SwitchBack version of F.linear(act(F.linear(x, fc1_weight, fc1_bias)), fc2_weight, fc2_bias).

    x (*, d) float; fc1_weight (h, d), fc2_weight (d', h); activation one of kernels.reference.ACTIVATIONS
    ("gelu", "gelu_tanh", "quick_gelu") -> (*, d') in x's dtype (or the autocast dtype). Same numerics as two
    switchback_linear calls around the activation, with fewer passes over the (*, h) tensors and only x and
    fc1's output saved for backward (x in 8-bit when config.memory_efficient). quantized_input: as in
    switchback_linear. weight_operands: (fc1's, fc2's) as in switchback_linear, or None.
    """
    if type(config) is not SwitchBackConfig:  # (no call in the usual case: a frame more for Dynamo to trace)
        check_config("switchback_mlp", config)
    args = (
        x,
        fc1_weight,
        fc1_bias,
        fc2_weight,
        fc2_bias,
        activation,
        config,
        quantized_input,
        weight_operands,
    )
    return graph_leaf.call("switchback_mlp_call", *args)


@graph_leaf.op("switchback_mlp_call")  # one leaf under torch.compile, as switchback_linear
def _switchback_mlp(
    x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, config, quantized_input, weight_operands
):
    if activation not in ACTIVATIONS:
        raise ValueError(f"switchback_mlp: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if fc2_weight.shape[1] != fc1_weight.shape[0]:
        raise RuntimeError(
            f"switchback_mlp: fc2_weight {tuple(fc2_weight.shape)} does not take fc1's {fc1_weight.shape[0]} outputs"
        )
    shapes = ((fc1_weight.shape[1], fc1_weight.shape[0]), (fc2_weight.shape[1], fc2_weight.shape[0]))
    config, x2d, leading, exact = _flatten_input(x, fc1_weight, config, shapes)
    device_type, dtype = x2d.device.type, x2d.dtype
    n_out = fc2_weight.shape[0]
    if exact:
        with _autocast_off(device_type):
            h = F.linear(x2d, fc1_weight.to(dtype), None if fc1_bias is None else fc1_bias.to(dtype))
            b2 = None if fc2_bias is None else fc2_bias.to(dtype)
            out = F.linear(apply_activation(h, activation), fc2_weight.to(dtype), b2)
        return out.reshape(*leading, n_out)

    fwd_qdtype, grad_qdtype = quantized_dtypes(config, x2d.device)
    x_q, x_scale = check_quantized_input("switchback_mlp", quantized_input, x2d, fwd_qdtype)
    spec = (activation, *linear_spec(config, fwd_qdtype, grad_qdtype))
    operands1 = operands2 = None
    if weight_operands is not None:
        qdtypes = (fwd_qdtype, grad_qdtype)
        operands1 = check_weight_operands("switchback_mlp", weight_operands[0], fc1_weight, qdtypes)
        operands2 = check_weight_operands("switchback_mlp", weight_operands[1], fc2_weight, qdtypes)
    out = graph_leaf.call(
        "switchback_mlp",
        x2d.contiguous(),
        fc1_weight,
        fc1_bias,
        fc2_weight,
        fc2_bias,
        spec,
        x_q,
        x_scale,
        operands1,
        operands2,
    )
    return out.reshape(*leading, n_out)


__all__ = [
    "AUTO_MIN_TOKENS_CUDA",
    "check_config",
    "check_input",
    "check_quantized_input",
    "check_weight_operands",
    "grad_precision",
    "has_fp8_tensor_cores",
    "linear_grads",
    "linear_spec",
    "quantize_weight",
    "quantized_dtypes",
    "runs_8bit",
    "switchback_linear",
    "switchback_mlp",
    "token_floor",
    "token_floor_range",
]
