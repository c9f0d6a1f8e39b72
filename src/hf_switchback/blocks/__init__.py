"""Block-level SwitchBack paths: modules that run several linears of one block through the functional API."""

from .multihead_attention import SwitchBackMultiheadAttention

__all__ = ["SwitchBackMultiheadAttention"]
