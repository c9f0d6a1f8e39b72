"""push_to_hub and the model card, intercepted at the huggingface_hub API boundary (no network)."""

import json
import shutil

import pytest
import torch
from helpers import tiny_clip_config
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.hf_api import RepoUrl
from safetensors.torch import load_file
from transformers import CLIPImageProcessor, CLIPModel

from hf_switchback import SwitchBackConfig, apply_switchback, model_card, push_to_hub, switchback_modules

CONFIG = SwitchBackConfig(weight_scaling="row", backend="torch")
TRAINING_ARGS = {
    "model_name_or_path": "openai/clip-vit-base-patch16",
    "dataset_name": "nlphuji/flickr30k",
    "learning_rate": 5e-4,
    "batch_size": 256,
    "epochs": 2,
    "hub_token": "hf_secret_do_not_publish",
    "wandb_key": "hf_also_secret",
}
METRICS = {"imagenet_zeroshot_top1": 0.6812, "coco_i2t_r@5": 0.8123}


@pytest.fixture
def hub_calls(monkeypatch, tmp_path):
    """Replace HfApi.create_repo / upload_folder; record their arguments and a copy of the uploaded folder."""
    calls = {}

    def create_repo(self, repo_id, *, token=None, private=None, exist_ok=False, **kwargs):
        calls["create_repo"] = {
            "repo_id": repo_id,
            "private": private,
            "exist_ok": exist_ok,
            "token": self.token,
        }
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, commit_message=None, **kwargs):
        snapshot = tmp_path / "uploaded"
        shutil.copytree(folder_path, snapshot)
        calls["upload_folder"] = {"repo_id": repo_id, "folder": snapshot, "commit_message": commit_message}
        return None

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return calls


def test_push_to_hub_uploads_model_processor_and_card(hub_calls):
    plain = CLIPModel(tiny_clip_config())
    model = CLIPModel(tiny_clip_config())
    model.load_state_dict(plain.state_dict())
    apply_switchback(model, CONFIG)  # converted in memory: config.json must still get quantization_config

    url = push_to_hub(
        model,
        CLIPImageProcessor(),
        "me/clip-switchback",
        switchback_config=CONFIG,
        training_args=TRAINING_ARGS,
        metrics=METRICS,
        private=True,
        token="hf_tok",
    )

    assert url == "https://huggingface.co/me/clip-switchback"
    assert hub_calls["create_repo"] == {
        "repo_id": "me/clip-switchback",
        "private": True,
        "exist_ok": True,
        "token": "hf_tok",
    }
    upload = hub_calls["upload_folder"]
    assert upload["repo_id"] == "me/clip-switchback" and "int8/row" in upload["commit_message"]
    folder = upload["folder"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "preprocessor_config.json",
    ]

    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"] == CONFIG.to_dict()
    assert config["architectures"] == ["CLIPModel"]
    weights = load_file(folder / "model.safetensors")
    reference = plain.state_dict()
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], v) and weights[k].dtype == v.dtype for k, v in reference.items())
    # The uploaded folder reloads as SwitchBack (hf_switchback is imported in this process).
    assert set(switchback_modules(CLIPModel.from_pretrained(folder))) == set(switchback_modules(model))


def test_model_card_content():
    text = model_card(
        "me/clip-switchback", switchback_config=CONFIG, training_args=TRAINING_ARGS, metrics=METRICS
    )
    card = ModelCard(text)
    assert card.data.base_model == "openai/clip-vit-base-patch16"
    assert card.data.library_name == "transformers"
    assert card.data.datasets == ["nlphuji/flickr30k"]
    assert "switchback" in card.data.tags

    for needle in (
        "Fine-tuned from [openai/clip-vit-base-patch16]",
        "| weight_scaling | row |",
        "| precision | int8 |",
        "`nlphuji/flickr30k`",
        "| learning_rate | 0.0005 |",
        "| batch_size | 256 |",
        "| imagenet_zeroshot_top1 | 0.6812 |",
        "| coco_i2t_r@5 | 0.8123 |",
        "import hf_switchback",
        'CLIPModel.from_pretrained("me/clip-switchback")',
        "Unknown quantization type, got switchback",
    ):
        assert needle in text, needle
    assert text.count("```python") == 2  # both ways to load
    assert "hf_secret" not in text and "hf_also_secret" not in text and "hub_token" not in text


def test_model_card_without_base_or_metrics():
    text = model_card("me/scratch", switchback_config=CONFIG, training_args={}, metrics={})
    assert "Trained from scratch." in text and text.count("Not recorded.") == 3
    assert ModelCard(text).data.base_model is None


def test_push_rejects_mismatched_config_before_creating_repo(hub_calls):
    model = apply_switchback(CLIPModel(tiny_clip_config()), CONFIG)
    with pytest.raises(ValueError, match="differs from the config"):
        push_to_hub(
            model,
            None,
            "me/x",
            switchback_config=SwitchBackConfig(backend="torch"),
            training_args={},
            metrics={},
        )
    assert hub_calls == {}


def test_model_card_publishes_no_local_absolute_paths():
    args = {
        "output_dir": "/home/me/runs/b32",
        "train_shards": "/data/laion/a.tar,/data/laion/b.tar",
        "train_file": "~/captions.csv",
        "validation_files": ["/srv/val/x.csv", "rel/y.csv"],
        "dataset_name": "nlphuji/flickr30k",
        "model_name_or_path": "/home/me/models/clip",
        "lr": 5e-4,
    }
    text = model_card("me/clip", switchback_config=CONFIG, training_args=args, metrics=METRICS)
    for local in ("/home/me", "/data/laion", "~/", "/srv/val"):
        assert local not in text, local
    for kept in (
        "| output_dir | b32 |",
        "| train_shards | a.tar,b.tar |",
        '["x.csv", "rel/y.csv"]',
        "nlphuji/flickr30k",
    ):
        assert kept in text, kept


def test_token_comes_from_hf_token_or_the_cached_login(monkeypatch, tmp_path):
    from huggingface_hub import constants

    from hf_switchback.hub import resolve_token

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))  # no cached login here yet
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert resolve_token() is None
    (tmp_path / "token").write_text("hf_cached_login")
    assert resolve_token() == "hf_cached_login"
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert resolve_token() == "hf_from_env"
    assert resolve_token("hf_explicit") == "hf_explicit"


def test_siglip_model_card_and_saved_folder(tmp_path):
    from transformers import SiglipConfig, SiglipModel

    from hf_switchback.hub import save_for_hub

    text = model_card(
        "me/siglip-sb", switchback_config=CONFIG, training_args={}, metrics={}, model_class="SiglipModel"
    )
    assert "siglip" in ModelCard(text).data.tags and "clip" not in ModelCard(text).data.tags
    assert (
        "torch.sigmoid(outputs.logits_per_image)" in text
        and 'SiglipModel.from_pretrained("me/siglip-sb")' in text
    )
    assert "sigmoid" not in model_card("me/c", switchback_config=CONFIG, training_args={}, metrics={})

    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    model = SiglipModel(
        SiglipConfig(
            text_config=dict(tower, vocab_size=64), vision_config=dict(tower, image_size=16, patch_size=8)
        )
    )
    apply_switchback(model, CONFIG)
    save_for_hub(
        model, None, tmp_path, "me/siglip-sb", switchback_config=CONFIG, training_args={}, metrics={}
    )
    assert (
        json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"]
        == "switchback"
    )
    assert "SiglipModel" in (tmp_path / "README.md").read_text()
    assert set(switchback_modules(SiglipModel.from_pretrained(tmp_path))) == set(switchback_modules(model))


def test_model_card_model_index_lists_the_eval_metrics():
    metrics = {"zero_shot_top1": 0.5, "image_to_text_R@5": 0.25, "train_loss": 1.0, "status": "completed"}
    card = ModelCard(
        model_card(
            "me/c", switchback_config=CONFIG, training_args={"validation_file": "/d/val.csv"}, metrics=metrics
        )
    )
    found = {
        (r.task_type, r.metric_type, r.metric_name, r.dataset_name, r.metric_value)
        for r in card.data.eval_results
    }
    assert found == {
        ("zero-shot-image-classification", "accuracy", "zero-shot top-1", "val.csv", 0.5),
        ("image-to-text", "recall", "image→text retrieval R@5", "val.csv", 0.25),
    }
    assert card.data.model_name == "c"
