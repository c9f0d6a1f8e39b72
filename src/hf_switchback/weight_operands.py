"""Each SwitchBack weight quantized once per weight update, not in every forward and backward.

A SwitchBack linear's 8-bit path reads its weight in two 8-bit forms: (N, K) for the forward GEMM and
transposed (K, N) for the grad-input GEMM. Quantized inside the op, they cost passes over the weight and
kernel launches at every forward and backward, where a step that waits on the host pays for each launch
(BENCHMARKS.md, Whole training step). With KernelOptions.cache_weight_operands (off by default) `apply_switchback` gives each
SwitchBackLinear a `WeightOperands` that keeps both forms, and the ops take them as arguments (graph inputs
under torch.compile). They are quantized by the same kernels from the same weight: the numerics do not change.

When they are refreshed: before a forward, in eager code, where the weight's storage or its version counter
(which every in-place update through torch bumps: load_state_dict, `.copy_`, torch's optimizers) differs from
the one they were quantized from, or, for a weight that requires grad, any torch.optim optimizer has stepped
since (bitsandbytes' 8-bit optimizers write through their own kernels and bump no version counter). Forward
pre-hooks do it, on the converted model and on each module on the way to a cached layer that a caller may
enter directly (an encoder, each of its layers); the outermost one that runs refreshes every layer below it,
and the inner ones see that it did (`_Scope`). A compiled graph takes the operands only when traced inside
such an eager refresh: with each encoder layer compiled (train_clip's `--torch_compile`, bench_train's
`--compile layers`), not under a whole-model torch.compile, whose hooks are traced into its graph (a refresh
there would be a graph break, an error with fullgraph=True): there the ops quantize the weights as before.
In eager mode each op also checks its own layer.

Which layers keep them: every layer starts with them (the first forward's graphs are traced with them); a
layer whose 8-bit path did not ask for them by the next refresh (it ran 16-bit, below its token floor) drops
them and asks again only if it runs 8-bit later (refreshed from then on; a compiled graph that saw none then
recompiles once). Never kept: weights sharded by FSDP2 (DTensor) or DeepSpeed ZeRO-3, whose full weight exists
only inside the forward; their ops quantize as before.

Memory: the two 8-bit copies, 2 bytes per weight value of each layer that keeps them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import refresh_graph
from .config import SwitchBackConfig
from .functional import quantize_weight, quantized_dtypes, runs_8bit
from .kernels.backends import get_kernels
from .weight_cache import has_weight_cache

OPERANDS = "_switchback_weight_operands"  # a SwitchBackLinear's WeightOperands
_SCOPE = "_switchback_operands_scope"  # the hooked module's _Scope (shared by one converted model)
_LAYERS = "_switchback_operands_layers"  # the hooked module's cached layers, refreshed by its hook
_HANDLES = "_switchback_operands_hooks"  # the hooked module's hook handles


class _Scope:
    """The hooked module of one converted model whose forward runs now, after its eager refresh of every layer
    below it (then the inner hooks do nothing), else None; `active`: whether there is one (what a compiled
    graph reads, and Dynamo guards on)."""

    def __init__(self) -> None:
        self.owner: nn.Module | None = None
        self.active = False
        self.every_layer: list[nn.Module] = []  # the model's own hook's layers
        self.graph: refresh_graph.RefreshGraph | None = None  # their refresh, captured


class WeightOperands:
    """One layer's 8-bit weight operands: `operands` = (w_q (N, K), w_scale, wt_q (K, N), wt_scale) in the
    forward and gradient formats of its config (functional.quantize_weight and the transposed quantizes of
    functional.linear_grads), or None; `key`: what the weight was when they were quantized."""

    def __init__(self, scope: _Scope) -> None:
        self.scope = scope
        self.operands: tuple[torch.Tensor, ...] | None = None
        self.key: tuple | None = None
        self.requested = False  # an 8-bit path asked for the operands (never reset)
        self.state = "new"  # new -> probe (kept for the first forward) -> live, or idle until requested


_optimizer_steps = 0  # torch.optim optimizer steps in this process (the step hook below counts them)
_step_hook = None


def _count_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _weight_key(weight: torch.Tensor) -> tuple:
    steps = _optimizer_steps if weight.requires_grad else 0  # a frozen weight is no optimizer's to change
    return (weight.data_ptr(), weight._version, steps, weight.dtype, weight.device)


def _full_weight(weight: torch.Tensor) -> bool:
    """Whether `weight` is the whole weight, not a shard whose full tensor exists only inside the forward."""
    if hasattr(weight, "ds_id") or weight.device.type == "meta":  # DeepSpeed ZeRO-3; not materialized
        return False
    return not (torch.distributed.is_available() and _is_dtensor(weight))


def _is_dtensor(weight: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def _quantize(layer: nn.Module) -> tuple[torch.Tensor, ...]:
    """(w_q, w_scale, wt_q, wt_scale) of layer.weight, as the ops would quantize it."""
    config: SwitchBackConfig = layer.switchback_config
    weight = layer.weight.detach()
    fwd_qdtype, grad_qdtype = quantized_dtypes(config, weight.device)
    options = config.kernel_options
    kernels = get_kernels(config.backend, weight.device, options)
    scaling = config.weight_scaling
    w_q, w_scale = quantize_weight(kernels, weight, scaling, fwd_qdtype, options)
    wt_q, wt_scale = quantize_weight(kernels, weight, scaling, grad_qdtype, options, transposed=True)
    return w_q, w_scale, wt_q, wt_scale


def _quantize_detached(layer: nn.Module) -> tuple[torch.Tensor, ...]:
    # Outside inference mode (a first forward under torch.inference_mode would make inference tensors, which a
    # later training forward's autograd cannot save) and autocast (the ops quantize with it off too).
    with (
        torch.no_grad(),
        torch.inference_mode(False),
        torch.autocast(layer.weight.device.type, enabled=False),
    ):
        return _quantize(layer)


def _kept(layers, settle: bool) -> list[nn.Module]:
    """The layers among `layers` that keep operands now. settle: a forward follows (a hook's call): a layer
    kept for the previous forward is then kept or dropped by whether its 8-bit path asked for them."""
    kept = []
    for layer in layers:
        group = getattr(layer, OPERANDS, None)
        if group is None or has_weight_cache(layer):  # prepare_for_inference's cache serves it (no grad)
            continue
        state = group.state
        if settle and (state == "probe" or (state == "idle" and group.requested)):
            # after the first forward: kept where an 8-bit path asked for them, dropped elsewhere
            state = group.state = "live" if group.requested else "idle"
            if state == "idle":
                group.operands = group.key = None
        elif settle and state == "new":
            state = group.state = "probe"
        if state not in ("new", "probe", "live"):
            continue
        if not _full_weight(layer.weight):
            group.operands, group.key, group.state = None, None, "sharded"
            continue
        kept.append(layer)
    return kept


def refresh_layers(layers, settle: bool = False, scope: _Scope | None = None) -> None:
    """Bring the operands of `layers` (SwitchBackLinear modules with a WeightOperands) up to date; settle: as
    in _kept. scope: the model's, when this refresh may run as its CUDA graph (refresh_graph.py): where every
    kept layer is stale (after an optimizer step) and the weights are CUDA tensors."""
    kept = _kept(layers, settle)
    keys = [_weight_key(layer.weight) for layer in kept]
    stale = [
        i for i, (layer, key) in enumerate(zip(kept, keys, strict=True))
        if getattr(layer, OPERANDS).operands is None or getattr(layer, OPERANDS).key != key
    ]  # fmt: skip
    if not stale:
        return
    graphable = (
        scope is not None
        and len(stale) == len(kept)
        and all(layer.weight.is_cuda for layer in kept)
        and len({layer.weight.device for layer in kept}) == 1
        and not torch.cuda.is_current_stream_capturing()
    )
    if graphable:
        graph = scope.graph
        if graph is None or not graph.covers(kept):
            scope.graph = graph = refresh_graph.capture(kept, _quantize_detached)
        if graph is not None:
            graph.replay()
            for layer, key, operands in zip(kept, keys, graph.outputs, strict=True):
                group = getattr(layer, OPERANDS)
                group.operands, group.key = operands, key
            return
    for i in stale:
        group = getattr(kept[i], OPERANDS)
        group.operands, group.key = _quantize_detached(kept[i]), keys[i]


def refresh_weight_operands(model: nn.Module) -> None:
    """Refresh every cached weight operand of `model` whose weight changed (the hooks do it before each
    forward, and in eager mode each op for its own layer)."""
    refresh_layers(m for m in model.modules() if hasattr(m, OPERANDS))


def cached_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every 8-bit weight operand `model` keeps now (memory held with the weights, not per step)."""
    groups = (getattr(m, OPERANDS) for m in model.modules() if hasattr(m, OPERANDS))
    return [t for group in groups for t in group.operands or ()]


def operands_for(layer: nn.Module, x: torch.Tensor | None = None) -> tuple[torch.Tensor, ...] | None:
    """The layer's cached 8-bit weight operands for its op, or None (the op quantizes the weight itself).

    x: the layer's input, when the caller does not know yet that the 8-bit path runs (then the answer is None
    where the 16-bit path runs); None: the caller runs the 8-bit path."""
    group = getattr(layer, OPERANDS, None)
    if group is None:
        return None
    if x is not None and not runs_8bit(layer.switchback_config, x, (layer.in_features, layer.out_features)):
        return None
    group.requested = True
    if torch.compiler.is_compiling():
        # in a graph only if an eager hook refreshed them for this forward (see the module docstring)
        return group.operands if group.scope.active else None
    if group.operands is not None:
        # eager: a call that entered below every hooked module still gets current operands
        refresh_layers((layer,))
    return group.operands


# The hooks: eager code only. Traced into a compiled graph they do nothing (a refresh there would be a graph
# break, an error under fullgraph=True).
def _before_forward(module: nn.Module, args) -> None:
    if torch.compiler.is_compiling():
        return
    scope = getattr(module, _SCOPE)
    if scope.owner is None:
        # the model's own hook (the usual entry, every layer) may refresh as one CUDA graph
        graph_scope = scope if getattr(module, _LAYERS) is scope.every_layer else None
        refresh_layers(getattr(module, _LAYERS), settle=True, scope=graph_scope)
        scope.owner, scope.active = module, True


def _after_forward(module: nn.Module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    scope = getattr(module, _SCOPE)
    if scope.owner is module:
        scope.owner, scope.active = None, False


def _detach(module: nn.Module) -> None:
    for handle in getattr(module, _HANDLES, ()):
        handle.remove()
    for name in (_HANDLES, _SCOPE, _LAYERS):
        if hasattr(module, name):
            delattr(module, name)


def _entry_points(model: nn.Module, names: list[str]) -> dict[str, list[str]]:
    """The modules a caller may enter on the way to the named layers, each with the layers below it: the
    model, each module holding a ModuleList (an encoder) and each element of one (a layer)."""
    modules = dict(model.named_modules())
    entries: dict[str, list[str]] = {"": list(names)}
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if isinstance(modules.get(parent), nn.ModuleList):
                for entry in (".".join(parts[: i - 1]), ".".join(parts[: i + 1])):
                    if entry and entry != name:
                        entries.setdefault(entry, []).append(name)
    return entries


def sync_weight_operands(model: nn.Module, layer_names: list[str]) -> int:
    """Give each named SwitchBackLinear of `model` whose options ask for it a WeightOperands (and drop it from
    every other module), and hook the model's entry points to refresh them; returns how many layers keep
    them. Called by apply_switchback and remove_switchback (with no names)."""
    global _step_hook
    for module in model.modules():
        _detach(module)
    names = [
        n
        for n in layer_names
        if model.get_submodule(n).switchback_config.kernel_options.cache_weight_operands
    ]
    for name, module in model.named_modules():
        if name not in names and hasattr(module, OPERANDS):
            delattr(module, OPERANDS)
    if not names:
        return 0
    scope = _Scope()
    scope.every_layer = [model.get_submodule(n) for n in names]
    for name in names:
        setattr(model.get_submodule(name), OPERANDS, WeightOperands(scope))
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_count_step)
    for entry, below in _entry_points(model, names).items():
        module = model.get_submodule(entry) if entry else model
        setattr(module, _SCOPE, scope)
        setattr(
            module, _LAYERS, scope.every_layer if module is model else [model.get_submodule(n) for n in below]
        )
        handles = (
            module.register_forward_pre_hook(_before_forward),
            module.register_forward_hook(_after_forward, always_call=True),
        )
        setattr(module, _HANDLES, handles)
    return len(names)


__all__ = [
    "WeightOperands",
    "cached_tensors",
    "operands_for",
    "refresh_weight_operands",
    "sync_weight_operands",
]
