"""bitsandbytes 8-bit optimizers: their second-moment state, and the two hooks our subclasses override.

Checked against bitsandbytes 0.50 (`Optimizer2State`: state keys `state2`, `absmax2`, `qmap2`, `step`, 256-value
quantization blocks; `Optimizer8bit.get_config` / `update_step`).
"""

from __future__ import annotations

import torch

# Optimizer2State quantizes its 8-bit states in blocks of this many values (hard-coded in bitsandbytes 0.50).
STATE_BLOCKSIZE = 256
# The methods of bnb.optim.optimizer.Optimizer8bit that our optimizer subclasses (training/optim.py) override.
HOOKS = ("get_config", "update_step")


def _broken(what: str) -> RuntimeError:
    return RuntimeError(
        f"bitsandbytes' optimizer internals changed in this version ({what}), which hf_switchback's 8-bit "
        "optimizers and --spike_monitor rely on. Use a bitsandbytes version in the range pyproject.toml's 'bnb' "
        "extra names, or the 'adamw' / 'stableadamw' optimizer."
    )


def check_optimizer_hooks(base: type) -> None:
    """RuntimeError unless `base` (a bitsandbytes optimizer class) still has the methods our subclasses override.

    Why private: bitsandbytes has no public per-optimizer way to keep chosen tensors in 32-bit state (its
    GlobalOptimManager is process-wide, keyed by id(param)) nor a hook to scale the learning rate per tensor,
    so the subclasses override `get_config` and `update_step`; if either is renamed the override would be
    silently ignored.
    """
    for name in HOOKS:
        if not callable(getattr(base, name, None)):
            raise _broken(f"{base.__name__}.{name} is missing")


def second_moment(state: dict) -> torch.Tensor:
    """The raw (not bias-corrected) second moment v of one parameter as fp32, from its bitsandbytes state.

    Why private: bitsandbytes exposes no accessor for its optimizer states; 8-bit states are block-wise
    quantized (`state2` uint8 with `absmax2` scales and the `qmap2` code), 32-bit ones are `state2` as is.
    """
    if "state2" not in state:
        raise _broken("the optimizer state has no 'state2'")
    s2 = state["state2"]
    if s2.dtype != torch.uint8:
        return s2.float()
    if "absmax2" not in state or "qmap2" not in state:
        raise _broken("an 8-bit 'state2' without 'absmax2' / 'qmap2'")
    import bitsandbytes.functional as bnb_F

    return bnb_F.dequantize_blockwise(
        s2, absmax=state["absmax2"], code=state["qmap2"], blocksize=STATE_BLOCKSIZE
    )


__all__ = ["STATE_BLOCKSIZE", "check_optimizer_hooks", "second_moment"]
