"""precision_summary / extra_repr: what the swapped layers run on a device, and why the rest falls back.

The CUDA cases run on the CPU: the GPU's compute capability and name are patched, so the crossover table
shipped for sm90 (kernels/crossover/sm90.json) decides, as it would on an H100.
"""

import logging

import pytest
import torch
from torch import nn
from transformers import CLIPModel

from hf_switchback import SwitchBackConfig, apply_switchback, precision_summary
from hf_switchback.kernels import crossover
from hf_switchback.modules import runs_text
from hf_switchback.precision_summary import layer_floors

# 512x512 int8 never paid on the H100 (null crossover in sm90.json); 32x64 has no family close enough, so it
# gets the fallback floor.
NEVER_SHAPE, FALLBACK_SHAPE = (512, 512), (32, 64)


def two_linears(**config):
    model = nn.Sequential(nn.Linear(*NEVER_SHAPE), nn.Linear(*FALLBACK_SHAPE))
    return apply_switchback(model, SwitchBackConfig(target_modules=["0", "1"], **config))


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(crossover, "cuda_capability", lambda kind, index: (9, 0) if kind == "cuda" else None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")


def test_cpu_every_layer_runs_the_reference_path(clip_config, caplog):
    with caplog.at_level(logging.INFO, logger="hf_switchback.convert"):
        model = apply_switchback(CLIPModel(clip_config))
    line = "hf_switchback on cpu (torch reference kernels: the same numerics, no speed-up): 24 of 24 swapped "
    assert any(r.getMessage().startswith(line) for r in caplog.records), caplog.text
    assert precision_summary(model, "cpu").endswith("24 of 24 swapped layers run int8 at any token count")
    assert repr(model.vision_model.encoder.layers[0].mlp.fc1).endswith("backend=auto, runs=int8)")


def test_explicit_min_tokens_is_named_as_the_reason():
    model = two_linears(min_tokens=100)
    assert precision_summary(model, "cpu").endswith(
        "0 of 2 swapped layers run int8 at any token count; 2 run int8 from 100 tokens per call and 16-bit "
        "below; floors from min_tokens=100"
    )
    assert repr(model[0]).endswith("runs=16-bit below 100 tokens)")


def test_hopper_table_sends_never_paying_shapes_to_16_bit(hopper):
    model = two_linears()
    floors = layer_floors(model, "cuda:0")
    assert floors == {"0": crossover.NEVER, "1": crossover.FALLBACK_MIN_TOKENS}
    assert precision_summary(model, "cuda:0") == (
        "hf_switchback on cuda:0 (NVIDIA H100 80GB HBM3): 0 of 2 swapped layers run int8 at any token count; "
        "1 run int8 from 16384 tokens per call and 16-bit below; 1 always fall back to 16-bit (int8 never "
        "pays for their shapes); floors from the measured crossover, kernels/crossover/sm90.json "
        "(SwitchBackConfig(min_tokens=0) forces 8-bit)"
    )


def test_fused_mlp_layers_share_the_block_floor(clip_config):
    model = apply_switchback(CLIPModel(clip_config), SwitchBackConfig(fuse_mlp=True, min_tokens=7))
    assert model.vision_model.encoder.layers[0].mlp._switchback_activation is not None  # the block is fused
    floors = layer_floors(model, "cpu")
    assert (
        floors["vision_model.encoder.layers.0.mlp.fc1"]
        == floors["vision_model.encoder.layers.0.mlp.fc2"]
        == 7
    )


@pytest.mark.parametrize(
    ("floor", "text"),
    [(0, "int8"), (16384, "16-bit below 16384 tokens"), (crossover.NEVER, "16-bit (int8 never pays here)")],
)
def test_runs_text(floor, text):
    assert runs_text(floor, "int8") == text


def test_model_without_switchback_layers():
    assert precision_summary(nn.Linear(2, 2)) == "hf_switchback: no SwitchBack layers"


def test_meta_weights_are_described_for_the_device_they_will_run_on():
    with torch.device("meta"):
        model = two_linears()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert precision_summary(model).startswith(f"hf_switchback on {expected}")
