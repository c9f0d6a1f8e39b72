"""One config.json rule for the final model, saved to --output_dir and pushed to the Hub alike: SwitchBack's
quantization_config (reloads as SwitchBack under hf_switchback), or with --save_plain a plain CLIPModel."""

import json
import shutil

import pytest
from train_helpers import load_script, run_in_process, write_tiny_model_config
from transformers import CLIPModel

from hf_switchback import SwitchBackLinear, hub, switchback_modules
from hf_switchback.hub import save_for_hub


class FakeApi:
    """HfApi without a network: upload_folder copies what would be uploaded into `dest`."""

    dest = None

    def __init__(self, token=None):
        pass

    def create_repo(self, repo_id, private=False, exist_ok=True):
        return type("RepoUrl", (), {"repo_id": repo_id, "__str__": lambda self: f"hub/{repo_id}"})()

    def upload_folder(self, repo_id, folder_path, commit_message):
        shutil.copytree(folder_path, FakeApi.dest)


def quant_method(folder) -> str | None:
    entry = json.loads((folder / "config.json").read_text()).get("quantization_config")
    return entry and entry["quant_method"]


@pytest.mark.parametrize("plain", [False, True])
def test_saved_and_pushed_model_reload_the_same_way(tmp_path, monkeypatch, plain):
    monkeypatch.setattr(hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    FakeApi.dest = tmp_path / "pushed"
    out = tmp_path / "run"
    argv = ["--model_config", write_tiny_model_config(str(tmp_path / "c.json")), "--max_train_steps", "1",
            "--batch_size", "8", "--eval_steps", "0", "--max_eval_samples", "16", "--output_dir", str(out),
            "--push_to_hub", "--hub_model_id", "me/clip-sb"] + (["--save_plain"] if plain else [])  # fmt: skip
    run_in_process(load_script(), argv)
    for folder in (out, FakeApi.dest):
        assert quant_method(folder) == (None if plain else "switchback"), folder
        swapped = switchback_modules(CLIPModel.from_pretrained(folder))
        # the tiny config has 1 layer per tower: q, k, v, out_proj, fc1, fc2 in each
        assert len(swapped) == (0 if plain else 12), folder
    card = (FakeApi.dest / "README.md").read_text()
    assert ("importing it restores the SwitchBack layers" in card) is not plain


def test_save_for_hub_plain_strips_a_loaded_quantization_config(tmp_path, clip_config):
    from hf_switchback import SwitchBackConfig, apply_switchback

    config = SwitchBackConfig()
    model = apply_switchback(CLIPModel(clip_config), config)
    save_for_hub(model, None, tmp_path / "sb", "me/x", switchback_config=config, training_args={}, metrics={})
    reloaded = CLIPModel.from_pretrained(tmp_path / "sb")  # now carries quantization_config in its config
    assert isinstance(reloaded.text_model.encoder.layers[0].mlp.fc1, SwitchBackLinear)
    save_for_hub(
        reloaded,
        None,
        tmp_path / "plain",
        "me/x",
        switchback_config=config,
        training_args={},
        metrics={},
        plain=True,
    )
    assert quant_method(tmp_path / "plain") is None
    assert not switchback_modules(CLIPModel.from_pretrained(tmp_path / "plain"))
