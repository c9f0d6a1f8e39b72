"""One function of ours in front of a torch function, where torch looks that function up (an attribute of a
module or a class): put there once, and taken out only while it is still the one in front.

kernels/early_compile.py, tiled_quantize_configs.py and direct_kernel_calls.py each change one step of
torch.compile this way. Where a caller has since put a function of its own in front of ours (a profiler, a test's
recorder), taking ours out would drop theirs too: ours then stays below theirs, inert (`active` false: it passes
every call on to torch's function), until installed again.
"""

from __future__ import annotations

from collections.abc import Callable


class FunctionInFront:
    """`wrap(torch_function)` makes our function; it reads `active` at each call and finds torch's function as
    its attribute `hf_switchback_original`, which this class sets."""

    def __init__(self, wrap: Callable[[Callable], Callable]) -> None:
        self._wrap = wrap
        self.ours: Callable | None = None  # our function, once put in front
        self.active = False

    def install(self, owner: object, name: str) -> None:
        if self.ours is None:
            original = getattr(owner, name)
            self.ours = self._wrap(original)
            self.ours.hf_switchback_original = original
            setattr(owner, name, self.ours)
        self.active = True

    def is_installed(self) -> bool:
        return self.ours is not None and self.active

    def uninstall(self, owner: object | None, name: str) -> None:
        self.active = False
        if owner is not None and self.ours is not None and getattr(owner, name, None) is self.ours:
            setattr(owner, name, self.ours.hf_switchback_original)
            self.ours = None


__all__ = ["FunctionInFront"]
