"""Zero-shot classification and image<->text retrieval, the two numbers CLIP training is judged by.

Every rank runs the same evaluation on the same (small) eval set through the *prepared* model's forward, so
wrappers that shard parameters (FSDP) or sync buffers (DDP) see the same collective calls on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from PIL import Image


@torch.no_grad()
def encode(
    model, tokenizer, image_processor, *, images=(), texts=(), batch_size=256, max_length=77, device=None
):
    """Normalized features: images (N_i, D) and texts (N_t, D), float32, via model(input_ids, pixel_values)
    (a CLIPModel or a CLIPForContrastive).

    The model's forward wants both inputs; when one list runs out the other is padded with its first item and
    the padding's features are dropped.
    """
    images, texts = list(images), list(texts)
    image_feats, text_feats = [], []
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
        # CLIPForContrastive returns (image, text, scale); a plain CLIPModel a CLIPOutput
        image_embeds, text_embeds = out[:2] if isinstance(out, tuple) else (out.image_embeds, out.text_embeds)
        # Copies, not views: under CUDA graphs (--compile_mode reduce-overhead) the next batch's replay
        # overwrites the model's outputs in place.
        if start < len(images):
            image_feats.append(image_embeds.to(torch.float32, copy=True))
        if start < len(texts):
            text_feats.append(text_embeds.to(torch.float32, copy=True))
    image_out = torch.cat(image_feats)[: len(images)] if image_feats else None
    text_out = torch.cat(text_feats)[: len(texts)] if text_feats else None
    return (
        None if image_out is None else F.normalize(image_out, dim=-1),
        None if text_out is None else F.normalize(text_out, dim=-1),
    )


def _blank_image(image_processor) -> Image.Image:
    size = getattr(image_processor, "crop_size", None) or {"height": 224, "width": 224}
    return Image.new("RGB", (size["width"], size["height"]))


def retrieval_metrics(image_features: torch.Tensor, text_features: torch.Tensor, ks=(1, 5)) -> dict:
    """Pair i of (N, D) images and (N, D) texts matches; recall@K both ways, in [0, 1]."""
    logits = image_features @ text_features.T
    target = torch.arange(len(logits), device=logits.device)
    metrics = {}
    for name, scores in (("image_to_text", logits), ("text_to_image", logits.T)):
        # rank of the right answer = number of candidates scored strictly higher
        right = scores.gather(1, target[:, None])
        rank = (scores > right).sum(dim=1)
        for k in ks:
            metrics[f"{name}_R@{k}"] = (rank < k).float().mean().item()
    return metrics


def zero_shot_classifier(model, tokenizer, image_processor, classnames, templates, **encode_kwargs):
    """(C, D) class embeddings: the normalized mean of each class's normalized prompt embeddings."""
    prompts = [t.format(c) for c in classnames for t in templates]
    _, text = encode(model, tokenizer, image_processor, images=[], texts=prompts, **encode_kwargs)
    text = text.view(len(classnames), len(templates), -1).mean(dim=1)
    return F.normalize(text, dim=-1)


def zero_shot_accuracy(image_features: torch.Tensor, classifier: torch.Tensor, labels, ks=(1, 5)) -> dict:
    labels = torch.as_tensor(labels, device=image_features.device)
    ks = [k for k in ks if k <= classifier.shape[0]]  # top-5 of 3 classes is meaningless
    top = (image_features @ classifier.T).topk(max(ks), dim=1).indices
    hits = top == labels[:, None]
    return {
        f"zero_shot_top{k}": hits[:, :k].any(dim=1).float().mean().item()
        for k in ks
        if k <= classifier.shape[0]
    }


def evaluate(
    model, tokenizer, image_processor, eval_set, *, classnames=None, templates=("a photo of a {}.",), **kw
):
    """eval_set = (images, captions, labels or None) -> {"image_to_text_R@1", ..., "zero_shot_top1", ...}."""
    images, captions, labels = eval_set
    was_training = model.training
    model.eval()
    try:
        image_features, text_features = encode(
            model, tokenizer, image_processor, images=images, texts=captions, **kw
        )
        metrics = retrieval_metrics(image_features, text_features)
        if classnames and labels is not None:
            classifier = zero_shot_classifier(model, tokenizer, image_processor, classnames, templates, **kw)
            metrics.update(zero_shot_accuracy(image_features, classifier, labels))
    finally:
        model.train(was_training)
    return metrics
