"""Small training parts: patch dropout, parameter groups, the schedule, the tokenizer, the evaluator, the teardown."""

import logging
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from train_helpers import tiny_model

from hf_switchback.training import lifecycle
from hf_switchback.training.evaluation import retrieval_metrics, zero_shot_accuracy
from hf_switchback.training.model_setup import PatchDropout, add_patch_dropout
from hf_switchback.training.optim import cosine_with_warmup, param_groups
from hf_switchback.training.synthetic import vocabulary
from hf_switchback.training.tokenizer import build_word_tokenizer


def test_patch_dropout_keeps_cls_and_a_random_subset_in_training_only():
    model = tiny_model()
    embeddings = model.vision_model.embeddings
    pixels = torch.randn(3, 3, 32, 32)
    full = embeddings(pixels)  # (3, 1 + 16, D)
    handle = add_patch_dropout(model, 0.5)
    dropped = embeddings(pixels)
    assert dropped.shape == (3, 1 + 8, full.shape[-1])
    assert torch.equal(dropped[:, 0], full[:, 0])  # class token first, unchanged
    for b in range(3):  # every kept token is one of the sample's own patch tokens, no repeats
        matches = (dropped[b, 1:, None] == full[b, None, 1:]).all(-1).nonzero()[:, 1]
        assert len(matches) == 8 and len(set(matches.tolist())) == 8
    model.eval()
    assert embeddings(pixels).shape == full.shape
    model.train()
    handle.remove()
    assert embeddings(pixels).shape == full.shape
    out = model(input_ids=torch.tensor([[2, 5, 3]]), pixel_values=pixels[:1])  # the whole model still runs
    assert out.image_embeds.shape == (1, 16)
    assert PatchDropout(0.0)(embeddings, (), full) is full


def test_param_groups_no_decay_on_norms_biases_embeddings_logit_scale():
    model = tiny_model()
    model.text_model.requires_grad_(False)
    groups = param_groups(model, weight_decay=0.2)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for p in groups[0]["params"]}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.2 and groups[1]["weight_decay"] == 0.0
    assert "vision_model.encoder.layers.0.mlp.fc1.weight" in decay
    assert "visual_projection.weight" in decay
    for name in ("logit_scale", "vision_model.pre_layrnorm.weight", "vision_model.encoder.layers.0.mlp.fc1.bias",
                 "vision_model.embeddings.class_embedding", "vision_model.embeddings.position_embedding.weight"):  # fmt: skip
        assert name in no_decay, name
    assert not any(n.startswith("text_model.") for n in decay | no_decay)  # frozen: not in the optimizer


def test_cosine_with_warmup():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = cosine_with_warmup(opt, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    lrs = []
    for _ in range(16):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert math.isclose(lrs[9], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert math.isclose(lrs[14], 0.1) and math.isclose(lrs[15], 0.1)


def test_word_tokenizer_frames_like_clip_and_round_trips(tmp_path):
    tok = build_word_tokenizer(vocabulary(), model_max_length=8)
    ids = tok(["a small red circle", "a zebra"], padding="max_length", truncation=True, max_length=8)[
        "input_ids"
    ]
    assert (
        ids[0][0] == tok.bos_token_id
        and ids[0][5] == tok.eos_token_id
        and ids[0][6:] == [tok.pad_token_id] * 2
    )
    assert ids[1][2] == tok.unk_token_id
    long = tok(["a " * 20], truncation=True, max_length=8)["input_ids"][0]
    assert len(long) == 8 and long[-1] == tok.eos_token_id  # truncation keeps the end token
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    assert (
        AutoTokenizer.from_pretrained(tmp_path)("a red circle")["input_ids"]
        == tok("a red circle")["input_ids"]
    )


def test_retrieval_and_zero_shot_metrics():
    feats = F.normalize(torch.randn(5, 8), dim=-1)
    perfect = retrieval_metrics(feats, feats)
    assert perfect["image_to_text_R@1"] == 1.0 and perfect["text_to_image_R@1"] == 1.0
    shuffled = retrieval_metrics(feats, feats[[1, 0, 2, 3, 4]])
    assert shuffled["image_to_text_R@1"] == pytest.approx(0.6)
    assert shuffled["image_to_text_R@5"] == 1.0
    assert zero_shot_accuracy(feats[:3], feats[:3], labels=[0, 1, 2])["zero_shot_top1"] == 1.0
    assert zero_shot_accuracy(feats[:3], feats[:3], labels=[1, 0, 2])["zero_shot_top1"] == pytest.approx(
        1 / 3
    )


def test_end_training_frees_the_prepared_model_and_says_when_something_still_holds_it(monkeypatch, caplog):
    """training/lifecycle.py: under DDP a model that outlives the process group can hang the exit;
    end_training frees what the accelerator holds and warns (on multi-process runs) when the caller still
    holds the model."""
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))  # the warning's condition
    monkeypatch.setattr(lifecycle, "WORKER_DRAIN_S", 0.0)
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(torch.nn.Linear(4, 4))
        with caplog.at_level(logging.WARNING, logger=lifecycle.__name__):
            lifecycle.end_training(accelerator, weakref.ref(model))  # the local `model` still holds it
        assert lifecycle.STILL_REFERENCED in caplog.text and accelerator._models == []
        caplog.clear()

        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(torch.nn.Linear(4, 4))
        model_ref, model = weakref.ref(model), None
        with caplog.at_level(logging.WARNING, logger=lifecycle.__name__):
            lifecycle.end_training(accelerator, model_ref)  # only the accelerator held it: freed
        assert model_ref() is None and lifecycle.STILL_REFERENCED not in caplog.text
    finally:
        AcceleratorState._reset_state(True)
