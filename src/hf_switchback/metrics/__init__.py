"""The evaluation metrics as `evaluate` modules shipped with the package, loaded by local path (no Hub, so
they work offline): zero-shot top-k accuracy and image<->text retrieval recall@K.

    import evaluate
    from hf_switchback import metrics
    recall = evaluate.load(metrics.path("retrieval_recall"))
    recall.compute(predictions=image_x_text_scores, references=range(n))
"""

from __future__ import annotations

import functools
from pathlib import Path

METRICS_DIR = Path(__file__).resolve().parent
NAMES = ("retrieval_recall", "zero_shot_accuracy")


def path(name: str) -> str:
    """The folder of metric `name`, for evaluate.load."""
    if name not in NAMES:
        raise ValueError(f"unknown hf_switchback metric {name!r}; choose one of {', '.join(NAMES)}")
    return str(METRICS_DIR / name)


def _evaluate():
    try:
        import evaluate
    except ImportError as err:
        raise ImportError(
            "the zero-shot and retrieval metrics need the evaluate package: pip install 'hf_switchback[train]'"
        ) from err
    return evaluate


@functools.cache
def load(name: str):
    """evaluate.load of metric `name`, in memory (no cache files next to the run), loaded once per process."""
    return _evaluate().load(path(name), keep_in_memory=True)


def save(file: str, results: dict) -> str:
    """Write `results` with evaluate.save (the values plus evaluate's run metadata: time, versions) to the
    JSON file `file`; returns its path."""
    return str(_evaluate().save(file, **results))


__all__ = ["METRICS_DIR", "NAMES", "load", "path", "save"]
