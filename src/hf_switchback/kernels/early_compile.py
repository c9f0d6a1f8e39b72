"""Start compiling our Triton kernels when Inductor writes their launch, as it does for its own kernels.

Inductor hands each kernel it generates to its compile workers the moment the kernel's code exists (its Triton
scheduling calls `async_compile.triton` there when the worker pool is ready), so those compiles run while the
rest of the graph's code is generated. A user-defined Triton kernel (ours, launched through wrap_triton) is only
written into the graph's module (`PythonWrapperCodegen.define_user_defined_triton_kernel`), and its compile
starts when that module is loaded, after all of the graph's code generation: the graph then waits for our
kernels' whole compile, 0.6-0.8 s each at ViT-B/16 (BENCHMARKS.md, compile warm-up).

`install()` puts a function in front of the wrapper's `define_kernel` that, for a kernel whose source file is in
this package, makes the early call Inductor makes for its own kernels, with the name and source text the module
will pass later. torch keys a compile by that text (`CompiledTritonKernels`), so the module's call finds the
compile under way and nothing compiles twice; where the text cannot be read as such a call, or the pool is not
ready, the kernel compiles when the module loads, as before. HF_SWITCHBACK_EARLY_KERNEL_COMPILE=0 leaves
torch's function alone. Measured at ViT-B/16 int8 on an H200 host: the first step's wait on the workers
3.2 s against 4.0 s (mean of three pairs), within the spread of the whole first step between processes.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import os
from collections.abc import Callable
from pathlib import Path

from .in_front import FunctionInFront

# torch writes this comment above a user-defined kernel's definition: "# Original path: <file>:<line>"
_ORIGIN = "# Original path: "
_PACKAGE = os.path.realpath(Path(__file__).resolve().parents[1])
# Since install: our kernels handed to the workers early, and those whose definition could not be read
# (benchmarks and tests read it).
stats = {"submitted": 0, "not_read": 0}
logger = logging.getLogger(__name__)


def is_ours(metadata: object) -> bool:
    """Whether `metadata`, the comment torch writes above a user-defined kernel, names a file of this package."""
    if not isinstance(metadata, str) or not metadata.startswith(_ORIGIN):
        return False
    path = metadata[len(_ORIGIN) :].rsplit(":", 1)[0]
    return os.path.realpath(path).startswith(_PACKAGE + os.sep)


def compile_call(kernel_body: str) -> tuple[str, str, dict[str, str]] | None:
    """(kernel name, source, keyword arguments) of a definition `async_compile.triton('name', '''source''', ...)`
    as the graph's module will evaluate it, or None for any other text."""
    try:
        tree = ast.parse(kernel_body.strip())
    except (SyntaxError, ValueError, RecursionError):  # ValueError: a null byte; RecursionError: deep nesting
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return None
    call = tree.body[0].value
    is_triton_call = (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "triton"
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "async_compile"
    )
    if not is_triton_call or len(call.args) != 2:
        return None
    values = [arg.value if isinstance(arg, ast.Constant) else None for arg in call.args]
    keywords = {kw.arg: kw.value.value for kw in call.keywords if isinstance(kw.value, ast.Constant)}
    if not all(isinstance(value, str) for value in values) or len(keywords) != len(call.keywords):
        return None
    return values[0], values[1], keywords


def _submitting(define_kernel: Callable) -> Callable:
    @functools.wraps(define_kernel)
    def define_and_submit(self, kernel_name, kernel_body, metadata=None, *args, **kwargs):
        if front.active and is_ours(metadata) and isinstance(kernel_body, str):
            _submit(kernel_body)
        return define_and_submit.hf_switchback_original(
            self, kernel_name, kernel_body, metadata, *args, **kwargs
        )

    return define_and_submit


front = FunctionInFront(_submitting)  # in front of PythonWrapperCodegen.define_kernel


def _submit(kernel_body: str) -> None:
    try:
        from torch._inductor.async_compile import AsyncCompile

        if os.environ.get("TRITON_INTERPRET", "0") == "1" or not AsyncCompile.use_process_pool():
            return  # no workers to hand it to: the module's call compiles it, here, as without a head start
        found = compile_call(kernel_body)
        if found is None:
            stats["not_read"] += 1
            logger.debug(
                "early_compile: a kernel definition of another form than known; compiled at module load"
            )
            return
        name, source, keywords = found
        AsyncCompile().triton(name, source, **keywords)
    except Exception:  # only a head start: the module's own call compiles the kernel, and reports its errors
        logger.debug("early_compile: no head start for a kernel", exc_info=True)
        return
    stats["submitted"] += 1


def _wrapper_class():
    """torch's Python wrapper codegen class where its define_kernel has the known signature, else None."""
    try:
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    except ImportError:
        return None
    define_kernel = getattr(PythonWrapperCodegen, "define_kernel", None)
    if define_kernel is None or not hasattr(AsyncCompile, "use_process_pool"):
        return None
    original = getattr(define_kernel, "hf_switchback_original", define_kernel)
    try:
        names = list(inspect.signature(original).parameters)[:4]
    except (TypeError, ValueError):
        return None
    return PythonWrapperCodegen if names == ["self", "kernel_name", "kernel_body", "metadata"] else None


def install() -> bool:
    """Submit our kernels early from now on (once). False where this torch's wrapper codegen differs from the
    known one, or HF_SWITCHBACK_EARLY_KERNEL_COMPILE=0."""
    if os.environ.get("HF_SWITCHBACK_EARLY_KERNEL_COMPILE", "1") == "0":
        return False
    wrapper = _wrapper_class()
    if wrapper is None:
        return False
    front.install(wrapper, "define_kernel")
    return True


def is_installed() -> bool:
    return front.is_installed()


def uninstall() -> None:
    """Stop submitting early and restore torch's function where ours is still the one in front (tests)."""
    front.uninstall(_wrapper_class(), "define_kernel")
    stats.update(submitted=0, not_read=0)


__all__ = ["compile_call", "install", "is_installed", "is_ours", "stats", "uninstall"]
