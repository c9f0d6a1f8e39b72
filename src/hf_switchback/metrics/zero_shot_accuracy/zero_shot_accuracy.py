"""zero_shot_accuracy: top-k accuracy of zero-shot classification (CLIP / SigLIP), an `evaluate` metric.

Load it offline by path: `evaluate.load(hf_switchback.metrics.path("zero_shot_accuracy"))`.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """Top-k accuracy of zero-shot classification: each image's scores against every class (a CLIP
model's logits image x class-prompt embedding), the true class index as reference. A hit at k: fewer than k
classes score strictly higher than the true one (a tie counts in the image's favour). With sigmoid=True (SigLIP,
scores = scale * cos + bias) also the mean p(true class) and the mean number of classes with p > 0.5."""

_KWARGS = """
Args:
    predictions: (N, C) float scores, one row per image over the C classes.
    references: (N,) int, the index of each image's true class.
    top_k: the k of top-k (default (1, 5)); a k larger than C is left out.
    sigmoid: the scores are SigLIP logits: also report the probability metrics.
Returns:
    {"zero_shot_top1": float in [0, 1], "zero_shot_top5": ..., and with sigmoid "zero_shot_prob_true",
    "zero_shot_classes_above_half"}
"""


class ZeroShotAccuracy(evaluate.Metric):
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

    def _compute(self, predictions, references, top_k=(1, 5), sigmoid=False):
        scores = np.asarray(predictions, dtype=np.float64)
        labels = np.asarray(references, dtype=np.int64)
        if (
            scores.ndim != 2
            or len(labels) != len(scores)
            or labels.min() < 0
            or labels.max() >= scores.shape[1]
        ):
            raise ValueError(
                f"zero_shot_accuracy: predictions must be (N, C) scores and references N class indices in "
                f"[0, C); got predictions {scores.shape} and references in [{labels.min()}, {labels.max()}]"
            )
        right = scores[np.arange(len(labels)), labels]
        rank = (scores > right[:, None]).sum(axis=1)
        metrics = {f"zero_shot_top{k}": float((rank < k).mean()) for k in top_k if k <= scores.shape[1]}
        if sigmoid:
            probs = 1.0 / (1.0 + np.exp(-scores))
            metrics["zero_shot_prob_true"] = float(probs[np.arange(len(labels)), labels].mean())
            metrics["zero_shot_classes_above_half"] = float((probs > 0.5).sum(axis=1).mean())
        return metrics
