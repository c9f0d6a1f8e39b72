"""Zero-shot classification and image<->text retrieval, the two numbers CLIP training is judged by.

Every rank runs the same evaluation on the same (small) eval set through the *prepared* model's forward, so
wrappers that shard parameters (FSDP) or sync buffers (DDP) see the same collective calls on every rank.

SigLIP scores a pair on its own: p(match) = sigmoid(logit_scale * cos + logit_bias). For a SigLIP model the
metrics also report those probabilities (pass `sigmoid=(logit_scale, logit_bias)`, logit_scale exp()'d). Ranks
and top-k come from the logits scale * cos + bias, never from the probabilities: in float32 the sigmoid rounds
many scores to exactly 0 or 1, and ties would count as hits. With scale > 0 that is the cosine's order.

The numbers themselves come from the `evaluate` metrics shipped in hf_switchback/metrics (loaded by path,
offline); this file computes the features and the logits they score.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from PIL import Image

from .. import metrics as metric_modules


@torch.no_grad()
def encode(
    model,
    tokenizer,
    image_processor,
    *,
    images=(),
    texts=(),
    batch_size=256,
    max_length=77,
    device=None,
    return_sigmoid=False,
):
    """Normalized features: images (N_i, D) and texts (N_t, D), float32, via model(input_ids, pixel_values)
    (a CLIPModel / SiglipModel or a CLIPForContrastive). return_sigmoid: also return (logit_scale exp()'d,
    logit_bias) as floats for a SigLIP model, None for CLIP.

    The model's forward wants both inputs; when one list runs out the other is padded with its first item and
    the padding's features are dropped.
    """
    images, texts = list(images), list(texts)
    image_feats, text_feats, sigmoid = [], [], None
    steps = max(len(images), len(texts))
    for start in range(0, steps, batch_size):
        chunk_images = images[start : start + batch_size] or images[:1] or [_blank_image(image_processor)]
        chunk_texts = texts[start : start + batch_size] or texts[:1] or [""]
        pixel_values = image_processor(images=chunk_images, return_tensors="pt")["pixel_values"]
        tokens = tokenizer(
            chunk_texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
        )
        out = model(
            input_ids=tokens["input_ids"].to(device),
            attention_mask=tokens["attention_mask"].to(device),
            pixel_values=pixel_values.to(device),
        )
        # CLIPForContrastive returns (image, text, scale[, bias]); a plain CLIPModel / SiglipModel its output
        image_embeds, text_embeds = out[:2] if isinstance(out, tuple) else (out.image_embeds, out.text_embeds)
        params = (
            out[2:]
            if isinstance(out, tuple)
            else (model.logit_scale.exp(), getattr(model, "logit_bias", None))
        )
        if len(params) == 2 and params[1] is not None:
            sigmoid = tuple(float(p.float().reshape(-1)[0]) for p in params)
        # Copies, not views: under CUDA graphs (--compile_mode reduce-overhead) the next batch's replay
        # overwrites the model's outputs in place.
        if start < len(images):
            image_feats.append(image_embeds.to(torch.float32, copy=True))
        if start < len(texts):
            text_feats.append(text_embeds.to(torch.float32, copy=True))
    image_out = torch.cat(image_feats)[: len(images)] if image_feats else None
    text_out = torch.cat(text_feats)[: len(texts)] if text_feats else None
    features = (
        None if image_out is None else F.normalize(image_out, dim=-1),
        None if text_out is None else F.normalize(text_out, dim=-1),
    )
    return (*features, sigmoid) if return_sigmoid else features


def _blank_image(image_processor) -> Image.Image:
    size = getattr(image_processor, "crop_size", None) or {"height": 224, "width": 224}
    return Image.new("RGB", (size["width"], size["height"]))


def _scores(features: torch.Tensor, candidates: torch.Tensor, sigmoid) -> torch.Tensor:
    """(N, M) logits: cosine, or SigLIP's scale * cos + bias."""
    logits = features @ candidates.T
    return logits if sigmoid is None else sigmoid[0] * logits + sigmoid[1]


def retrieval_metrics(
    image_features: torch.Tensor, text_features: torch.Tensor, ks=(1, 5), sigmoid=None
) -> dict:
    """Pair i of (N, D) images and (N, D) texts matches; recall@K both ways, in [0, 1], through the shipped
    `retrieval_recall` evaluate metric. sigmoid=(scale, bias) (SigLIP) adds the mean p(match) of the matching
    pairs and of all the others."""
    scores = _scores(image_features, text_features, sigmoid)
    return metric_modules.load("retrieval_recall").compute(
        predictions=scores.float().cpu().numpy(),
        references=range(len(scores)),
        ks=tuple(ks),
        sigmoid=sigmoid is not None,
    )


def zero_shot_classifier(model, tokenizer, image_processor, classnames, templates, **encode_kwargs):
    """(C, D) class embeddings: the normalized mean of each class's normalized prompt embeddings."""
    prompts = [t.format(c) for c in classnames for t in templates]
    _, text = encode(model, tokenizer, image_processor, images=[], texts=prompts, **encode_kwargs)
    text = text.view(len(classnames), len(templates), -1).mean(dim=1)
    return F.normalize(text, dim=-1)


def zero_shot_accuracy(
    image_features: torch.Tensor, classifier: torch.Tensor, labels, ks=(1, 5), sigmoid=None
) -> dict:
    """Top-k accuracy of (N, D) images against (C, D) class embeddings, through the shipped
    `zero_shot_accuracy` evaluate metric (a k above C is left out). sigmoid=(scale, bias) (SigLIP) adds the mean
    p(true class) and the mean number of classes with p > 0.5 (SigLIP may call none or several)."""
    scores = _scores(image_features, classifier, sigmoid)
    return metric_modules.load("zero_shot_accuracy").compute(
        predictions=scores.float().cpu().numpy(),
        references=torch.as_tensor(labels).cpu().numpy(),
        top_k=tuple(ks),
        sigmoid=sigmoid is not None,
    )


def evaluate(
    model, tokenizer, image_processor, eval_set, *, classnames=None, templates=("a photo of a {}.",), **kw
):
    """eval_set = (images, captions, labels or None) -> {"image_to_text_R@1", ..., "zero_shot_top1", ...}, plus
    the sigmoid probabilities for a SigLIP model."""
    images, captions, labels = eval_set
    was_training = model.training
    model.eval()
    try:
        image_features, text_features, sigmoid = encode(
            model, tokenizer, image_processor, images=images, texts=captions, return_sigmoid=True, **kw
        )
        metrics = retrieval_metrics(image_features, text_features, sigmoid=sigmoid)
        if classnames and labels is not None:
            classifier = zero_shot_classifier(model, tokenizer, image_processor, classnames, templates, **kw)
            metrics.update(zero_shot_accuracy(image_features, classifier, labels, sigmoid=sigmoid))
    finally:
        model.train(was_training)
    return metrics
