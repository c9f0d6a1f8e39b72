"""SwitchBackConfig validation and (de)serialization."""

import json
import re

import pytest

from hf_switchback import DEFAULT_EXCLUDE_MODULES, DEFAULT_TARGET_MODULES, SwitchBackConfig


def test_defaults_are_the_clip_encoder_linears():
    cfg = SwitchBackConfig()
    assert cfg.weight_scaling == "tensor" and cfg.precision == "int8" and cfg.backend == "auto"
    assert cfg.memory_efficient is False and cfg.min_tokens is None
    assert cfg.target_modules == DEFAULT_TARGET_MODULES
    assert set(DEFAULT_TARGET_MODULES) == {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}
    assert cfg.exclude_modules == DEFAULT_EXCLUDE_MODULES
    assert DEFAULT_EXCLUDE_MODULES == ("visual_projection", "text_projection", "head.mlp.fc1", "head.mlp.fc2")


@pytest.mark.parametrize(
    "field,value",
    [
        ("weight_scaling", "column"),
        ("precision", "int4"),
        ("backend", "cuda"),
        ("fp8_grad_format", "e3m4"),
        ("grad_precision", "int4"),
    ],
)
def test_bad_choice_names_the_field_and_allowed_values(field, value):
    with pytest.raises(ValueError) as err:
        SwitchBackConfig(**{field: value})
    msg = str(err.value)
    assert f"SwitchBackConfig.{field}" in msg and repr(value) in msg and "one of" in msg


def test_bad_types_are_rejected():
    with pytest.raises(TypeError, match="memory_efficient"):
        SwitchBackConfig(memory_efficient="yes")
    with pytest.raises(TypeError, match="target_modules"):
        SwitchBackConfig(target_modules=3)
    with pytest.raises(ValueError, match="exclude_modules"):
        SwitchBackConfig(exclude_modules=["fc1", ""])
    with pytest.raises(ValueError, match="min_tokens"):
        SwitchBackConfig(min_tokens=-1)


def test_is_frozen_and_lists_become_tuples():
    cfg = SwitchBackConfig(target_modules=["fc1", "fc2"])
    assert cfg.target_modules == ("fc1", "fc2")
    with pytest.raises(AttributeError):
        cfg.precision = "fp8"
    assert cfg.replace(precision="fp8").precision == "fp8"


def test_none_targets_mean_the_defaults():
    assert SwitchBackConfig(target_modules=None).target_modules == DEFAULT_TARGET_MODULES
    assert SwitchBackConfig(exclude_modules=None).exclude_modules is None


def test_dict_round_trip_through_json():
    cfg = SwitchBackConfig(
        weight_scaling="row", memory_efficient=True, precision="fp8", target_modules=r".*fc\d"
    )
    data = json.loads(json.dumps(cfg.to_dict()))
    assert SwitchBackConfig.from_dict(data) == cfg


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown keys"):
        SwitchBackConfig.from_dict({"weight_scale": "row"})


def test_variant_name():
    assert SwitchBackConfig(weight_scaling="row", memory_efficient=True).variant == "int8/row/mem-efficient"


def test_invalid_regex_is_rejected_at_construction():
    with pytest.raises(ValueError, match=r"SwitchBackConfig.target_modules: 'fc\(' is not a valid regex"):
        SwitchBackConfig(target_modules="fc(")


@pytest.mark.parametrize(
    "pattern, problem",
    [
        ("([a-z_.0-9]+)+Z", "a repeat inside a repeated group (nested quantifiers)"),
        ("(a?)*b", "a repeat inside a repeated group (nested quantifiers)"),
        ("(?:fc|fc1)+", "an alternation inside a repeated group"),
        (r"(fc)\1", "a back-reference"),
    ],
)
def test_regexes_that_can_backtrack_exponentially_are_refused(pattern, problem):
    with pytest.raises(
        ValueError, match=rf"regex .* has {re.escape(problem)}, which can take exponential time"
    ):
        SwitchBackConfig(target_modules=pattern)
    with pytest.raises(ValueError, match="exclude_modules"):
        SwitchBackConfig.from_dict({"exclude_modules": pattern})


@pytest.mark.parametrize("pattern", [r".*fc\d", r"text_model\..*", r"(.*\.)?(q|k|v)_proj", r".*mlp\.fc\d"])
def test_simple_regexes_are_accepted(pattern):
    assert SwitchBackConfig(target_modules=pattern).target_modules == pattern
