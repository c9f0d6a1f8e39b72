"""The shipped evaluate metrics (hf_switchback/metrics) against a brute-force reference: every score compared
one by one in Python, so ties, permutations and k above the candidate count are checked independently."""

import math
import random
from pathlib import Path

import numpy as np
import pytest

from hf_switchback import metrics

REPO = Path(__file__).resolve().parents[1]


def rank(row, right):
    """Candidates scoring strictly higher than the right one (a tie counts for the sample)."""
    return sum(1 for j, v in enumerate(row) if j != right and v > row[right])


def reference_recall(scores, texts, k):
    n = len(texts)
    i2t = sum(rank(scores[i], texts[i]) < k for i in range(n)) / n
    columns = [[scores[i][t] for i in range(n)] for t in range(n)]
    image_of = {t: i for i, t in enumerate(texts)}
    t2i = sum(rank(columns[t], image_of[t]) < k for t in range(n)) / n
    return i2t, t2i


@pytest.mark.parametrize("seed", [0, 1])
def test_retrieval_recall_matches_brute_force(seed):
    rng = random.Random(seed)
    n = 9
    # scores on a coarse grid: many ties, which must count in the sample's favour
    scores = [[rng.choice([0.0, 0.5, 1.0]) for _ in range(n)] for _ in range(n)]
    texts = list(range(n))
    rng.shuffle(texts)
    got = metrics.load("retrieval_recall").compute(predictions=scores, references=texts, ks=(1, 3))
    for k in (1, 3):
        i2t, t2i = reference_recall(scores, texts, k)
        assert got[f"image_to_text_R@{k}"] == pytest.approx(i2t, abs=1e-12)
        assert got[f"text_to_image_R@{k}"] == pytest.approx(t2i, abs=1e-12)


def test_retrieval_sigmoid_probabilities():
    scores = [[2.0, -1.0], [0.0, 3.0]]
    got = metrics.load("retrieval_recall").compute(predictions=scores, references=[0, 1], sigmoid=True)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert got["pair_prob_matching"] == pytest.approx((sig(2.0) + sig(3.0)) / 2, rel=1e-6)
    assert got["pair_prob_other"] == pytest.approx((sig(-1.0) + sig(0.0)) / 2, rel=1e-6)


def test_zero_shot_accuracy_matches_brute_force():
    rng = random.Random(2)
    scores = [[rng.choice([0.0, 1.0, 2.0]) for _ in range(4)] for _ in range(20)]
    labels = [rng.randrange(4) for _ in range(20)]
    got = metrics.load("zero_shot_accuracy").compute(predictions=scores, references=labels, top_k=(1, 2, 5))
    for k in (1, 2):
        expected = sum(rank(s, y) < k for s, y in zip(scores, labels, strict=True)) / len(labels)
        assert got[f"zero_shot_top{k}"] == pytest.approx(expected, abs=1e-12)
    assert "zero_shot_top5" not in got  # 4 classes: top-5 is meaningless


@pytest.mark.parametrize(
    ("name", "references", "message"),
    [("zero_shot_accuracy", [0, 7], "class indices"), ("retrieval_recall", [0, 0], "permutation")],
)
def test_bad_references_raise_naming_the_problem(name, references, message):
    with pytest.raises(ValueError, match=message):
        metrics.load(name).compute(predictions=np.zeros((2, 2)), references=references)


def test_unknown_metric_name():
    with pytest.raises(ValueError, match="choose one of retrieval_recall, zero_shot_accuracy"):
        metrics.path("recall")


def test_package_data_ships_every_metric_script():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["hf_switchback.metrics"]
    shipped = {
        p.relative_to(metrics.METRICS_DIR) for pattern in patterns for p in metrics.METRICS_DIR.glob(pattern)
    }
    assert {Path(name) / f"{name}.py" for name in metrics.NAMES} <= shipped
