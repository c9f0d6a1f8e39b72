"""accelerate: the mixed precision of an already created Accelerator, and a collective timeout that always
reaches torch.distributed.

Checked against accelerate 1.15 (`AcceleratorState._shared_state`, `KwargsHandler.to_kwargs`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from datetime import timedelta


def accelerator_mixed_precision() -> str | None:
    """The `mixed_precision` of the Accelerator created in this process, or None when there is none yet.

    Why private: the public route, `AcceleratorState().mixed_precision`, initializes the distributed environment
    (PartialState) as a side effect when called before an Accelerator exists, which a check run at model
    conversion time must never do. The singleton's shared dict holds the value without that side effect.
    Fallback when the dict is gone in a later accelerate: a RuntimeWarning and None, so only the
    `ACCELERATE_MIXED_PRECISION` environment variable (what `accelerate launch` sets) is checked.
    """
    try:
        from accelerate.state import AcceleratorState
    except ImportError:  # accelerate is a dependency, but this check must not be what breaks an import
        return None
    shared = getattr(AcceleratorState, "_shared_state", None)
    if not isinstance(shared, Mapping):
        warnings.warn(
            "accelerate no longer keeps AcceleratorState._shared_state, so hf_switchback cannot see whether an "
            "Accelerator(mixed_precision='fp8') was created in this process; only ACCELERATE_MIXED_PRECISION is "
            "checked. Use an accelerate version in the range pyproject.toml names.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return shared.get("_mixed_precision")


def init_process_group_kwargs(timeout: timedelta):
    """An `InitProcessGroupKwargs` for `Accelerator(kwargs_handlers=[...])` whose timeout always reaches
    torch.distributed.init_process_group.

    accelerate passes on only the fields that differ from the class defaults (`to_kwargs`), and its default
    timeout is NCCL's 10 min, so a 10 min timeout would be dropped and gloo would keep torch's 30. The public
    constructor is used as is whenever accelerate passes the timeout on; only then is this instance's
    `to_kwargs` (the method Accelerator calls on the handler) replaced to always include it. accelerate looks
    handlers up by exact class, so a subclass cannot do this. RuntimeError when `to_kwargs` is gone.
    """
    from accelerate.utils import InitProcessGroupKwargs

    handler = InitProcessGroupKwargs(timeout=timeout)
    to_kwargs = getattr(handler, "to_kwargs", None)
    if not callable(to_kwargs):
        raise RuntimeError(
            "accelerate's InitProcessGroupKwargs has no to_kwargs() in this version, so hf_switchback cannot pass "
            "the collective timeout on. Use an accelerate version in the range pyproject.toml names."
        )
    passed = to_kwargs()
    if passed.get("timeout") != timeout:
        # A snapshot: accelerate's to_kwargs would list this instance attribute as a field once it is set.
        handler.to_kwargs = lambda: {**passed, "timeout": timeout}
    return handler


__all__ = ["accelerator_mixed_precision", "init_process_group_kwargs"]
