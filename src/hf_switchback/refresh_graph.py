"""The refresh of many layers' weight operands as one CUDA graph (weight_operands.py uses it).

After each optimizer step every trained layer's 8-bit weight operands are quantized again: two to four small
kernels per layer. Launched from Python they cost ~0.1 ms of host time per layer, more than the quantize
itself, and in a host-bound step (ViT-B/16, width 768) every step waits for them. Captured once into a CUDA
graph, the whole refresh is one launch: the graph reads each weight from its address and writes the
operands into tensors of its own pool, which the layers then keep (updated in place at every replay).

A graph replays only for the exact layers and weight addresses it captured; anything else (a weight
replaced by a new tensor, another set of layers) refreshes eagerly and captures again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)


class RefreshGraph:
    """A captured refresh of `layers`: replay() rewrites `outputs` (one tuple per layer) in place."""

    def __init__(self, layers: list[nn.Module], quantize: Callable[[nn.Module], tuple]) -> None:
        self.layers = list(layers)
        self.addresses = [layer.weight.data_ptr() for layer in self.layers]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # a warm-up outside the capture (lazy initialization, autotuning)
            for layer in self.layers:
                quantize(layer)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = [quantize(layer) for layer in self.layers]

    def covers(self, layers: list[nn.Module]) -> bool:
        """Whether replay() refreshes exactly `layers`, from the addresses their weights have now."""
        return len(layers) == len(self.layers) and all(
            a is b and a.weight.data_ptr() == address
            for a, b, address in zip(layers, self.layers, self.addresses, strict=True)
        )

    def replay(self) -> None:
        self.graph.replay()


def capture(layers: list[nn.Module], quantize: Callable[[nn.Module], tuple]) -> RefreshGraph | None:
    """A RefreshGraph of `layers` (CUDA weights, all on one device), or None where capturing failed (logged
    once; the refresh then stays eager)."""
    try:
        with torch.cuda.device(layers[0].weight.device), torch.no_grad():
            return RefreshGraph(layers, quantize)
    except Exception as err:  # a capture failure must never stop training: the eager refresh still works
        _warn_once(f"{type(err).__name__}: {err}")
        return None


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning(
            "hf_switchback: the weight operands refresh stays eager (CUDA graph capture failed: %s)", reason
        )


__all__ = ["RefreshGraph", "capture"]
