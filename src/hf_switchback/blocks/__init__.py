"""Block-level fused paths: transformers encoder blocks whose swapped linears run as one SwitchBack op."""

from .attention import is_fused_attention, sync_fused_attention
from .qkv import switchback_qkv

__all__ = ["is_fused_attention", "switchback_qkv", "sync_fused_attention"]
