"""Shared fixtures: tiny CLIP models built from configs (no downloads), deterministic seeds."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def tiny_clip_config(layers: int = 2, hidden: int = 32):
    """A CLIPConfig small enough for CPU tests: both towers, `layers` encoder layers each."""
    from transformers import CLIPConfig

    text = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        vocab_size=64,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    vision = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)


@pytest.fixture
def clip_config():
    return tiny_clip_config()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
