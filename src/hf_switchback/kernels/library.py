"""The kernel operations, each declared once: name, signature, output shapes, implementation per device.

Every step a SwitchBack layer runs (quantize, 8-bit GEMM, the fused MLP's activation passes) is one entry of
`OPS` and one `torch.library` operator, `torch.ops.hf_switchback.<name>`:
- its signature is the torch twin's in kernels/reference.py (without `options`), plus the KernelOptions fields
  that pick between CUDA implementations (`KernelOp.options`), so the twin is the readable statement of the
  numerics and of the arguments;
- its fake (meta) implementation is the `fake` here, so torch.compile traces it without running it;
- its CPU implementation, and that of any device without Triton, is the torch twin; its CUDA implementation
  is the Triton kernel (or cuBLAS) that kernels/ops.py hands to `declare`. Where that implementation launches
  its kernels through `torch.library.wrap_triton` (`KernelOp.traceable`), the operator is a `triton_op`:
  under torch.compile, Inductor sees the Triton launches and makes them from its generated code, with no
  Python call per step.

A kernel set (what `backends.get_kernels` returns) is built from this table by `kernel_set`: one function per
operator, taking the twin's arguments and the caller's `options`, and a policy that picks which implementation
runs: once per operator, and per call only where the choice depends on the call. Adding a kernel is one entry
here, its twin in reference.py and its CUDA implementation.

This module never imports triton: the CPU path declares the operators with their torch twins only.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from . import reference
from .cublas import MIXED_FP8_PAIRS
from .options import KernelOptions

LIBRARY = "hf_switchback"

# The schema defaults of the option arguments: what a direct `torch.ops.hf_switchback.*` call gets when it
# leaves them out. Kernel sets always pass the caller's KernelOptions.
_OPTION_DEFAULTS = {"use_tma": False, "fp8_gemm": "auto", "act_backward_impl": "auto"}


def _rows(x, qdtype=torch.int8, *_, **__):
    return x.new_empty(x.shape, dtype=qdtype), x.new_empty((x.shape[0],), dtype=torch.float32)


def _act_rows(h, qdtype=torch.int8, *_, **__):
    return (torch.empty_like(h), *_rows(h, qdtype))


def _rows_colsum(x, qdtype=torch.int8, *_, **__):
    return (*_rows(x, qdtype), x.new_empty((x.shape[1],), dtype=torch.float32))


def _tensor(x, qdtype=torch.int8, **_):
    return x.new_empty(x.shape, dtype=qdtype), x.new_empty((), dtype=torch.float32)


def _rows_transposed(w, qdtype=torch.int8, **_):
    n, k = w.shape
    return w.new_empty((k, n), dtype=qdtype), w.new_empty((k,), dtype=torch.float32)


def _tensor_transposed(w, qdtype=torch.int8, **_):
    n, k = w.shape
    return w.new_empty((k, n), dtype=qdtype), w.new_empty((), dtype=torch.float32)


def _over_tokens(x, qdtype=torch.int8, pad_to=1, **_):
    m, c = x.shape
    return x.new_empty((c, m + (-m % pad_to)), dtype=qdtype), x.new_empty((c,), dtype=torch.float32)


def _requantized_over_tokens(x_q, x_scale, dtype, qdtype, pad_to=1, **_):
    return _over_tokens(x_q, qdtype, pad_to)


def _dequantized(q, scale, dtype=torch.float32, **_):
    return q.new_empty(q.shape, dtype=dtype)


def _gemm(a_q, b_q, a_scale, b_scale, bias, out_dtype, *_, **__):
    # mixed fp8 formats (e4m3 x e5m2 grads) only where the CUDA implementation sends them to cuBLAS
    if a_q.dtype != b_q.dtype and (a_q.dtype, b_q.dtype) not in MIXED_FP8_PAIRS:
        raise TypeError(f"scaled_matmul: operands must share a dtype, got {a_q.dtype} and {b_q.dtype}")
    return a_q.new_empty((a_q.shape[0], b_q.shape[0]), dtype=out_dtype)


def _act_backward(m, n, grad_dtype, h, qdtype, want_act):
    return (
        h.new_empty((m, n), dtype=grad_dtype),
        h.new_empty((m, n) if want_act else (0,)),
        h.new_empty((m, n), dtype=qdtype),
        h.new_empty((m,), dtype=torch.float32),
        h.new_empty((n,), dtype=torch.float32),
    )


def _act_backward_colsum(grad, h, qdtype, activation, want_act, *_, **__):
    return _act_backward(*grad.shape, grad.dtype, h, qdtype, want_act)


def _gemm_act_backward(a_q, b_q, a_scale, b_scale, h, qdtype, activation, want_act, *_, **__):
    return _act_backward(a_q.shape[0], b_q.shape[0], h.dtype, h, qdtype, want_act)


def _normalized_rows(x, weight, bias, eps, qdtype, out_dtype, **_):
    m = x.shape[0]
    stats = x.new_empty((m,), dtype=torch.float32)
    return (*_rows(x, qdtype), x.new_empty(x.shape, dtype=out_dtype), stats, torch.empty_like(stats))


def _added_normalized_rows(x, delta, weight, bias, eps, qdtype, out_dtype, **_):
    h = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, delta.dtype))
    return (h, *_normalized_rows(x, weight, bias, eps, qdtype, out_dtype))


@dataclass(frozen=True)
class KernelOp:
    """One operator: `name` is its torch twin in reference.py, its `torch.ops.hf_switchback` name and the
    kernel-set function; `fake` gives its outputs' shapes, dtypes and devices without computing them."""

    name: str
    fake: Callable
    # KernelOptions fields the CUDA implementation takes, as trailing operator arguments (bool, str: the kinds
    # an operator schema holds). The torch twin ignores them.
    options: tuple[str, ...] = ()
    # The CUDA implementation launches every kernel through its `wrap` argument, so it can be a triton_op.
    traceable: bool = False

    @property
    def qualname(self) -> str:
        return f"{LIBRARY}::{self.name}"

    @property
    def reference(self) -> Callable:
        return getattr(reference, self.name)

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        """The operator's arguments: the twin's, `options` replaced by the option fields."""
        twin = inspect.signature(self.reference, eval_str=True)
        params = [p for p in twin.parameters.values() if p.name != "options"]
        hints = typing.get_type_hints(KernelOptions)
        params += [
            inspect.Parameter(
                f, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=_OPTION_DEFAULTS[f], annotation=hints[f]
            )
            for f in self.options
        ]
        return twin.replace(parameters=params)

    @functools.cached_property
    def schema(self) -> str:
        def prototype(*args, **kwargs): ...

        prototype.__signature__ = self.signature
        return torch.library.infer_schema(prototype, mutates_args=())

    @functools.cached_property
    def _defaults(self) -> tuple:
        params = [p for p in self.signature.parameters.values() if p.name not in self.options]
        return tuple(p.default for p in params)

    @property
    def arity(self) -> int:
        """How many arguments the twin takes (the operator's, less the option fields)."""
        return len(self._defaults)

    def arguments(self, args: tuple, kwargs: Mapping) -> tuple:
        """The twin's positional arguments of a call, its defaults filled in."""
        if kwargs:
            twin = list(self.signature.parameters.values())[: self.arity]
            bound = self.signature.replace(parameters=twin).bind(*args, **kwargs)
            bound.apply_defaults()
            return tuple(bound.arguments.values())
        if len(args) < len(self._defaults):
            missing = self._defaults[len(args) :]
            if any(d is inspect.Parameter.empty for d in missing):
                raise TypeError(f"{self.name}() missing arguments: {self.signature}")
            args = (*args, *missing)
        return args

    def option_values(self, options: KernelOptions) -> tuple:
        return tuple(getattr(options, f) for f in self.options)


_GEMM_OPTIONS = ("use_tma", "fp8_gemm")

# The operators, in the order a SwitchBack layer's forward and backward first call them.
OPS: tuple[KernelOp, ...] = (
    # the LayerNorm before q/k/v or fc1 writing that linear's 8-bit input too (blocks/encoder_layer.py)
    KernelOp("layernorm_quantize_rowwise", _normalized_rows, traceable=True),
    KernelOp("add_layernorm_quantize_rowwise", _added_normalized_rows, traceable=True),
    # traced: blocks/producers.quantize_rows launches it from the compiled graph (the attention output)
    KernelOp("quantize_rowwise", _rows, traceable=True),
    KernelOp("quantize_rowwise_colsum", _rows_colsum, traceable=True),
    KernelOp("quantize_tensorwise", _tensor),
    KernelOp("quantize_rowwise_transposed", _rows_transposed),
    KernelOp("quantize_tensorwise_transposed", _tensor_transposed),
    KernelOp("dequantize_rowwise", _dequantized),
    # fp8 grad-weight operands (kernels/wgrad.py): scales per feature over all tokens, written token-major
    KernelOp("quantize_over_tokens", _over_tokens, traceable=True),
    KernelOp("requantize_over_tokens", _requantized_over_tokens, traceable=True),
    KernelOp("scaled_matmul", _gemm, _GEMM_OPTIONS, traceable=True),
    # The same GEMM as an opaque operator: backward's recompute of a forward GEMM must be a different node from
    # forward's, or the joint graph's common-subexpression pass merges them and saves the output after all;
    # and the TMA kernel's host-side setup cannot be traced.
    KernelOp("scaled_matmul_recompute", _gemm, _GEMM_OPTIONS),
    KernelOp("act_quantize_rowwise", _rows, traceable=True),
    # the separate MLP layers' activation writing fc2's input in 16 and 8 bits (config.fuse_activation)
    KernelOp("act_and_quantize_rowwise", _act_rows, traceable=True),
    KernelOp("act_backward_quantize_colsum", _act_backward_colsum, ("act_backward_impl",), traceable=True),
    KernelOp(
        "scaled_matmul_act_backward",
        _gemm_act_backward,
        (*_GEMM_OPTIONS, "act_backward_impl"),
        traceable=True,
    ),
)
for _op in OPS:  # derived once here, so calls traced by torch.compile read plain attributes
    _op.arity, _op.schema  # noqa: B018
OP_NAMES = tuple(op.name for op in OPS)
BY_NAME = {op.name: op for op in OPS}

_declared: dict[str, object] = {}  # name -> the operator's CustomOpDef
_with_cuda: set[str] = set()


def _run_twin(op: KernelOp) -> Callable:
    def twin(*args):
        return op.reference(*args[: op.arity])

    return twin


def _all_arguments(op: KernelOp, args: tuple, kwargs: Mapping) -> tuple:
    """Every operator argument of a call, positionally. A traced graph leaves out arguments equal to their schema
    defaults, and torch 2.11 calls an implementation with the graph's arguments as they are (Inductor's code
    calling a triton_op body; a custom_op's CUDA kernel reached through its autograd layer, which drops them)."""
    bound = op.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def _with_defaults(op: KernelOp, cuda: Callable) -> Callable:
    """A custom_op's CUDA kernel that fills in the arguments a traced call left out."""

    def kernel(*args, **kwargs):
        return cuda(*_all_arguments(op, args, kwargs))

    return kernel


def _device_dispatch(op: KernelOp, cuda: Callable) -> Callable:
    """A triton_op's body: the CUDA implementation for CUDA tensors, launching through wrap_triton (which
    Inductor records under torch.compile and which launches directly in eager), the torch twin elsewhere."""

    def body(*args, **kwargs):
        args = _all_arguments(op, args, kwargs)
        if args[0].device.type == "cuda":
            return cuda(*args, wrap=torch.library.wrap_triton)
        return op.reference(*args[: op.arity])

    body.__signature__ = op.signature
    return body


def declare(cuda: Mapping[str, Callable] | None = None) -> None:
    """Register every operator of OPS with torch (once per process), with `cuda`'s implementations for CUDA.

    kernels/ops.py calls this with the Triton implementations when it is imported (CUDA and triton present);
    elsewhere the operators run their torch twins on every device. Operators declared before the CUDA
    implementations arrived get them as opaque CUDA kernels (correct, but not traced by torch.compile).
    """
    cuda = cuda or {}
    for op in OPS:
        impl = cuda.get(op.name)
        if op.name not in _declared:
            if impl is not None and op.traceable:
                opdef = torch.library.triton_op(op.qualname, _device_dispatch(op, impl), mutates_args=())
                _with_cuda.add(op.name)
            else:
                opdef = torch.library.custom_op(op.qualname, _run_twin(op), mutates_args=(), schema=op.schema)
            opdef.register_fake(op.fake)
            _declared[op.name] = opdef
        if impl is not None and op.name not in _with_cuda:
            _declared[op.name].register_kernel("cuda", _with_defaults(op, impl))
            _with_cuda.add(op.name)


def declared() -> dict[str, object]:
    """name -> CustomOpDef of the operators declared so far (all of OPS once `declare` ran)."""
    return dict(_declared)


# A policy is asked once per operator, when a kernel set is built: policy(op) -> route. The route picks, per call,
# the implementation that runs: route(options, twin arguments) -> a callable taking (*twin arguments, options=).
# torch.compile traces every call of a route and of what it returns (tens per layer, in forward and backward),
# so whatever does not depend on the call (the callables, which options matter) is settled once, here.
Route = Callable[[KernelOptions, tuple], Callable]
Policy = Callable[[KernelOp], Route]


def call_twin(op: KernelOp) -> Callable:
    name = op.name
    # looked up per call, so a patched twin is the one that runs
    return lambda *args, options: getattr(reference, name)(*args, options=options)


def call_operator(op: KernelOp) -> Callable:
    packet = getattr(torch.ops.hf_switchback, op.name)
    fields = op.options
    if not fields:
        return lambda *args, options: packet(*args)
    # map over a tuple, not op.option_values' generator: a generator is one more frame for Dynamo to trace
    return lambda *args, options: packet(*args, *map(getattr, (options,) * len(fields), fields))


def fixed(implementation: Callable) -> Route:
    """The route of an operator whose implementation does not depend on the call."""
    return lambda options, args: implementation


class KernelSet:
    """One function per operator of OPS (same name, the twin's arguments plus keyword `options`, the caller's
    KernelOptions; None means the defaults), each running what `policy`'s route picks for the call, or the
    torch twin when `policy` is None."""

    def __init__(self, name: str, policy: Policy | None) -> None:
        self.name = name
        for op in OPS:
            setattr(self, op.name, self._function(op, None if policy is None else policy(op)))

    @staticmethod
    def _function(op: KernelOp, route: Route | None) -> Callable:
        arity, name = op.arity, op.name

        def function(*args, options: KernelOptions | None = None, **kwargs):
            # the layers pass every twin argument positionally: nothing to bind or fill in
            if kwargs or len(args) < arity:
                args = op.arguments(args, kwargs)
            if route is None:
                # looked up per call, so a patched twin is the one that runs; the twins ignore `options`
                return getattr(reference, name)(*args, options=options)
            if options is None:  # the defaults (a kernel called directly, outside a SwitchBack layer)
                options = KernelOptions()
            return route(options, args)(*args, options=options)

        function.__name__ = function.__qualname__ = op.name
        function.__doc__ = op.reference.__doc__
        function.__signature__ = inspect.signature(op.reference)
        return function

    def __repr__(self) -> str:
        return f"KernelSet({self.name!r})"


# The torch twins on any device: the CPU path and backend="torch".
REFERENCE = KernelSet("reference", None)

__all__ = [
    "BY_NAME",
    "LIBRARY",
    "OPS",
    "OP_NAMES",
    "REFERENCE",
    "KernelOp",
    "KernelSet",
    "declare",
    "declared",
]
