"""A whole-model torch.compile compiles each tower's encoder layer once, not once per layer.

torch.compile of a whole CLIP / SigLIP model inlines all 12-32 layers of a tower into one graph, and AOT
autograd and Inductor then trace, partition, lower and generate code for each copy: with SwitchBack's bigger
layer graphs that is where a whole-model compile spends most of its first step (BENCHMARKS.md, compile
warm-up). A forward marked with `torch.compiler.nested_compile_region` is traced by Dynamo as a subgraph that
later layers of the same structure reuse (torch's hierarchical compilation), so every stage after Dynamo works on
one layer per tower, as a per-layer compile does. Outside torch.compile the marking calls the forward unchanged.

The fused encoder layers (blocks/encoder_layer.py) get their forward marked; torch versions without the function
(before 2.8) keep the plain forward. HF_SWITCHBACK_NESTED_COMPILE_REGION=0, set before apply_switchback, leaves
the forward unmarked (the inlined whole-model graph, for comparison or a torch whose hierarchical compile fails).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

ENV_VAR = "HF_SWITCHBACK_NESTED_COMPILE_REGION"


def available() -> bool:
    """Whether this torch has nested compile regions."""
    return hasattr(torch.compiler, "nested_compile_region")


def enabled() -> bool:
    """Whether forwards get marked: available, and the environment does not say no."""
    return available() and os.environ.get(ENV_VAR, "1") != "0"


def compiled_once(forward: Callable) -> Callable:
    """`forward` marked as a nested compile region (a function taking the module first, set on a class)."""
    return torch.compiler.nested_compile_region(forward)


__all__ = ["ENV_VAR", "available", "compiled_once", "enabled"]
