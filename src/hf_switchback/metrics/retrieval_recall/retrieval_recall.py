"""retrieval_recall: image->text and text->image recall@K over paired images and captions, an `evaluate`
metric.

Load it offline by path: `evaluate.load(hf_switchback.metrics.path("retrieval_recall"))`.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """Recall@K both ways for N images and N captions where image i's caption is text references[i]:
predictions row i holds image i's scores against every text (a CLIP model's logits). Image->text: a hit when
fewer than K texts score strictly higher than the right one; text->image: the same over the columns. With
sigmoid=True (SigLIP logits) also the mean p(match) of the matching pairs and of all other pairs."""

_KWARGS = """
Args:
    predictions: (N, N) float scores, rows images, columns texts.
    references: (N,) int, the text index of each image's caption (a permutation; range(N) for aligned lists).
    ks: the K of recall@K (default (1, 5)).
    sigmoid: the scores are SigLIP logits: also report "pair_prob_matching" and "pair_prob_other".
Returns:
    {"image_to_text_R@1": float in [0, 1], ..., "text_to_image_R@1": ..., ...}
"""


class RetrievalRecall(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("float32")),
                    "references": datasets.Value("int64"),
                }
            ),
        )

    def _compute(self, predictions, references, ks=(1, 5), sigmoid=False):
        scores = np.asarray(predictions, dtype=np.float64)
        texts = np.asarray(references, dtype=np.int64)
        n = len(texts)
        if scores.shape != (n, n) or sorted(texts.tolist()) != list(range(n)):
            raise ValueError(
                f"retrieval_recall: predictions must be (N, N) image x text scores and references a permutation "
                f"of range(N) (one caption per image); got predictions {scores.shape} and {n} references"
            )
        images = np.arange(n)
        metrics = {}
        right = scores[images, texts]
        # rows: each image's right text among all texts; columns: each caption's image among all images
        for name, rank in (
            ("image_to_text", (scores > right[:, None]).sum(axis=1)),
            ("text_to_image", (scores[:, texts] > right[None, :]).sum(axis=0)),
        ):
            for k in ks:
                metrics[f"{name}_R@{k}"] = float((rank < k).mean())
        if sigmoid:
            probs = 1.0 / (1.0 + np.exp(-scores))
            matching = np.zeros_like(probs, dtype=bool)
            matching[images, texts] = True
            metrics["pair_prob_matching"] = float(probs[matching].mean())
            if n > 1:
                metrics["pair_prob_other"] = float(probs[~matching].mean())
        return metrics
