"""Shared fixtures: tiny CLIP models built from configs (no downloads), deterministic seeds, the gpu marker.

Helpers shared by several test files live in helpers.py.
"""

import os

import pytest
import torch
from helpers import HAS_GPU, tiny_clip_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests (declared in pyproject.toml) skip cleanly without CUDA + triton."""
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs CUDA and triton")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def clip_config():
    return tiny_clip_config()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
