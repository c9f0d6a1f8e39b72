"""Our Triton kernel calls turned into their mutating form directly, not by tracing a graph per call.

In the graph Inductor lowers, every Triton kernel call first appears in functional form
(`triton_kernel_wrapper_functional`: it returns clones of the tensors the kernel writes), and torch's post-grad
pass `decompose_triton_kernel_wrapper_functional` rewrites each into the clones and the mutating call
(`triton_kernel_wrapper_mutation`) through the pattern matcher's `replace_by_example`, which traces a small
replacement graph with make_fx per call (twice in torch 2.11: once on the eager input values, once on
Inductor's; once in 2.13). Our kernels write only buffers their op allocated, so once torch's reinplacing pass has
run, a call of ours clones nothing and nothing reads its result: its mutating form is the same node without
`tensors_to_clone`. Those 20-32 calls of
a ViT-B/16 step made that pass 0.36-0.73 s of its cold first step (0.09-0.16 s at ViT-L/14 and ViT-H/14, whose
text tower is 16-bit; BENCHMARKS.md, compile warm-up).

`install()` puts a function in front of that pass (torch's post-grad module calls it by its module name) that
rewrites such calls of our kernels in place, the node's metadata carried over as torch's replacement carries it
(the tests compare the two graphs), and then runs torch's pass for every other call. A call that still clones a
tensor, has a user or lacks the recorded eager input values, or a kernel not of this package, is left to torch; a
failure while rewriting one call leaves that call whole for torch's pass (logged as a warning).
HF_SWITCHBACK_DIRECT_KERNEL_CALLS=0 leaves torch's pass alone.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable

from .in_front import FunctionInFront
from .kernel_access import of_this_package

# Since install: calls rewritten here (benchmarks and tests read it).
stats = {"rewritten": 0}
logger = logging.getLogger(__name__)
_MUTATION_KWARGS = ("kernel_idx", "constant_args_idx", "grid", "tma_descriptor_metadata", "kwargs")
_FUNCTIONAL_KWARGS = frozenset({*_MUTATION_KWARGS, "tensors_to_clone"})


def _rewritable(node) -> bool:
    """A functional call torch's pass would turn into the mutating call alone: no clone, no user, the known
    arguments, eager input values recorded (torch's replacement carries them), a kernel of this package."""
    kwargs = node.kwargs
    return (
        not node.args
        and not node.users
        and not kwargs.get("tensors_to_clone")
        and set(kwargs) == _FUNCTIONAL_KWARGS
        and node.meta.get("eager_input_vals") is not None
        and of_this_package(kwargs["kernel_idx"])
    )


def rewrite_calls(graph) -> int:
    """Rewrite, in `graph`, each functional call of one of our kernels that clones nothing and has no user into its
    mutating call (counted in `stats` one by one); returns how many."""
    import torch
    from torch._inductor.pattern_matcher import _transfer_meta

    functional = torch.ops.higher_order.triton_kernel_wrapper_functional
    mutation = torch.ops.higher_order.triton_kernel_wrapper_mutation
    rewritten = 0
    for node in list(graph.find_nodes(op="call_function", target=functional)):
        if not _rewritable(node):
            continue
        # The new node's metadata first, so that a failure leaves this call whole for torch's pass: what torch's
        # replacement keeps (the fields every pattern replacement copies, the stack trace, the functional node's
        # value, its eager input values without the argument the mutating call lacks).
        meta: dict = {}
        _transfer_meta(new_meta=meta, old_node=node, pass_name="replace_by_example")
        if "val" in node.meta:
            meta["val"] = node.meta["val"]
        eager_args, eager_kwargs = node.meta["eager_input_vals"]
        meta["eager_input_vals"] = (eager_args, {key: eager_kwargs[key] for key in _MUTATION_KWARGS})
        with graph.inserting_before(node):
            call = graph.call_function(mutation, kwargs={key: node.kwargs[key] for key in _MUTATION_KWARGS})
        call.meta.update(meta)
        graph.erase_node(node)
        rewritten += 1
        stats["rewritten"] += 1
    return rewritten


def _rewriting_first(decompose: Callable) -> Callable:
    @functools.wraps(decompose)
    def rewrite_then_decompose(graph, *args, **kwargs):
        if front.active:
            try:
                rewrite_calls(graph)
            except Exception:  # torch's pass below decomposes whatever is left, as without this module
                logger.warning("direct_kernel_calls: calls left to torch's pass", exc_info=True)
        return rewrite_then_decompose.hf_switchback_original(graph, *args, **kwargs)

    return rewrite_then_decompose


front = FunctionInFront(_rewriting_first)  # in front of post_grad.decompose_triton_kernel_wrapper_functional
_PASS = "decompose_triton_kernel_wrapper_functional"


def _post_grad_module():
    """torch's post-grad pass module where it has the known pass and the pieces the rewrite uses, else None."""
    try:
        import torch
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table  # noqa: F401
        from torch._inductor.fx_passes import post_grad
        from torch._inductor.pattern_matcher import _transfer_meta  # noqa: F401
    except ImportError:
        return None
    decompose = getattr(post_grad, _PASS, None)
    if not callable(decompose):
        return None
    try:  # (ours, if in front, has torch's signature through functools.wraps)
        if list(inspect.signature(decompose).parameters)[:1] != ["graph"]:
            return None
    except (TypeError, ValueError):
        return None
    if not hasattr(torch.ops.higher_order, "triton_kernel_wrapper_mutation"):
        return None
    return post_grad


def install() -> bool:
    """Rewrite our kernels' calls directly from now on (once). False where this torch's post-grad module differs
    from the known one, or HF_SWITCHBACK_DIRECT_KERNEL_CALLS=0."""
    if os.environ.get("HF_SWITCHBACK_DIRECT_KERNEL_CALLS", "1") == "0":
        return False
    post_grad = _post_grad_module()
    if post_grad is None:
        return False
    front.install(post_grad, _PASS)
    return True


def is_installed() -> bool:
    return front.is_installed()


def uninstall() -> None:
    """Leave every call to torch's pass again, restoring it where ours is still the one in front (tests)."""
    front.uninstall(_post_grad_module(), _PASS)
    stats.update(rewritten=0)


__all__ = ["install", "is_installed", "rewrite_calls", "stats", "uninstall"]
