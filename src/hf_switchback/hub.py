"""Publish a SwitchBack-trained model to the Hugging Face Hub: weights, processor and a model card.

The pushed folder is exactly what `save_pretrained` writes (plain safetensors, config.json with the
"switchback" quantization_config) plus the processor files and a generated README.md, so the repo loads
both with hf_switchback (SwitchBack layers restored) and with plain transformers (a standard CLIPModel).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

from huggingface_hub import EvalResult, HfApi, ModelCardData
from torch import nn

from .config import SwitchBackConfig
from .convert import switchback_modules
from .quantizer import strip_quantization_config, write_quantization_config

# Dataset names are looked up under these training-argument keys, in this order.
DATASET_KEYS = ("dataset_name", "dataset", "train_data", "data")
# Keys whose values must never reach a public model card.
_SECRET_KEYS = re.compile(r"(^|_)(token|password|secret|key)$", re.IGNORECASE)
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _public_args(training_args: Mapping[str, Any]) -> dict[str, Any]:
    """training_args minus secrets (hub tokens are a common resident of argparse namespaces), local absolute
    paths cut to their last component (they tell readers nothing and publish the author's file system)."""
    return {
        k: _without_local_paths(v)
        for k, v in training_args.items()
        if not _SECRET_KEYS.search(k) and not (isinstance(v, str) and v.startswith("hf_"))
    }


def _without_local_paths(value: Any) -> Any:
    """ "/home/me/runs/b32" -> "b32", also inside comma lists ("/data/a.tar,/data/b.tar") and lists."""
    if isinstance(value, (list, tuple)):
        return type(value)(_without_local_paths(v) for v in value)
    if not isinstance(value, str) or "://" in value:
        return value
    parts = value.split(",")
    local = [os.path.isabs(p) or p.startswith("~") for p in parts]
    if not any(local):
        return value
    return ",".join(
        os.path.basename(p.rstrip("/")) if is_local else p for p, is_local in zip(parts, local, strict=True)
    )


def resolve_token(token: str | None = None) -> str | None:
    """The Hub token: `token` when given, else HF_TOKEN or the cached login (`hf auth login`), as
    huggingface_hub resolves it; None when there is none."""
    if token:
        return token
    from huggingface_hub import get_token

    return get_token()


def _hub_id_or_none(name: Any) -> str | None:
    """`name` when it looks like a Hub repo id rather than a local path (a model card cannot link those)."""
    if isinstance(name, str) and _REPO_ID.match(name) and not os.path.exists(name):
        return name
    return None


# Where the card's model-index says the evaluation ran, looked up under these training-argument keys in order.
EVAL_DATA_KEYS = (
    "validation_file",
    "validation_shards",
    "dataset_name",
    "train_file",
    "train_data_dir",
    "train_shards",
)
# metric key prefix -> (task type, metric type, readable name prefix), for the model-index
_EVAL_METRICS = {
    "zero_shot_top": ("zero-shot-image-classification", "accuracy", "zero-shot top-"),
    "image_to_text_R@": ("image-to-text", "recall", "image→text retrieval R@"),
    "text_to_image_R@": ("text-to-image", "recall", "text→image retrieval R@"),
}


def eval_results(metrics: Mapping[str, Any], training_args: Mapping[str, Any]) -> list[EvalResult]:
    """The model-index entries of the shipped evaluate metrics (zero-shot top-k, recall@K) found in
    `metrics`; the eval data as the training arguments name it (the embedded synthetic set when none)."""
    args = _public_args(training_args)
    data = next((str(args[k]) for k in EVAL_DATA_KEYS if args.get(k)), "synthetic-shapes")
    results = []
    for key, value in sorted(metrics.items()):
        for prefix, (task, metric_type, name) in _EVAL_METRICS.items():
            if key.startswith(prefix) and isinstance(value, (int, float)) and not isinstance(value, bool):
                results.append(
                    EvalResult(
                        task_type=task,
                        dataset_type=data,
                        dataset_name=data,
                        metric_type=metric_type,
                        metric_name=name + key.removeprefix(prefix),
                        metric_value=value,
                    )
                )
    return results


def _cell(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, tuple, dict, bool)) or value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: Mapping[str, Any], header: tuple[str, str]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in sorted(rows.items())]
    return "\n".join(lines)


def model_card(
    repo_id: str,
    *,
    switchback_config: SwitchBackConfig,
    training_args: Mapping[str, Any],
    metrics: Mapping[str, Any],
    base_model: str | None = None,
    model_class: str = "CLIPModel",
    plain: bool = False,
) -> str:
    """README.md text for a SwitchBack-trained model: YAML metadata, config, data, hyper-parameters,
    metrics and a usage snippet with both ways to load (plain: config.json has no quantization_config, so one
    way). Secrets in training_args are left out."""
    args = _public_args(training_args)
    base = _hub_id_or_none(base_model) or _hub_id_or_none(args.get("model_name_or_path"))
    datasets = [str(args[k]) for k in DATASET_KEYS if args.get(k)]
    siglip = model_class.startswith("Siglip")
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="zero-shot-image-classification",
        tags=[
            "siglip" if siglip else "clip",
            "switchback",
            "hf_switchback",
            f"{switchback_config.precision}-training",
        ],
        base_model=base,
        datasets=[d for d in datasets if _hub_id_or_none(d)] or None,
        # model-index: what the Hub shows as evaluation results (needs the model's name)
        model_name=repo_id.split("/")[-1],
        eval_results=eval_results(metrics, training_args) or None,
    )
    sb = switchback_config.to_dict()
    sections = [
        f"---\n{card_data.to_yaml()}\n---",
        f"# {repo_id.split('/')[-1]}",
        f"A {model_class} trained with SwitchBack {switchback_config.variant} linear layers "
        "([Wortsman, Dettmers et al., 2023](https://arxiv.org/abs/2304.13013)) using "
        "`hf_switchback`. Forward and input-gradient matmuls of the selected linears ran "
        "in 8 bit; the weight gradient and everything else in 16 bit. The weights are stored unquantized, as "
        "ordinary safetensors." + (SIGLIP_NOTE if siglip else ""),
        "## Base model\n\n"
        + (f"Fine-tuned from [{base}](https://huggingface.co/{base})." if base else "Trained from scratch."),
        "## SwitchBack configuration\n\n" + _table(sb, ("field", "value")),
        "## Training data\n\n" + (", ".join(f"`{d}`" for d in datasets) if datasets else "Not recorded."),
        "## Training hyper-parameters\n\n"
        + (_table(args, ("argument", "value")) if args else "Not recorded."),
        "## Evaluation\n\n" + (_table(metrics, ("metric", "value")) if metrics else "Not recorded."),
        _plain_usage(repo_id, model_class) if plain else _usage(repo_id, model_class),
    ]
    return "\n\n".join(sections) + "\n"


SIGLIP_NOTE = (
    " Trained with SigLIP's sigmoid loss ([Zhai et al., 2023](https://arxiv.org/abs/2303.15343)): each "
    "image-text pair is scored on its own, p(match) = `torch.sigmoid(outputs.logits_per_image)` (not a softmax "
    'over the candidates). Tokenize text with `padding="max_length"`, as in training: the text tower pools '
    "the last position."
)


def _usage(repo_id: str, model_class: str) -> str:
    return f"""## Usage

With `hf_switchback` installed, importing it restores the SwitchBack layers from
`config.json` (for further training, or int8 inference with `prepare_for_inference`):

```python
import hf_switchback  # registers the "switchback" quantization method with transformers
from transformers import AutoProcessor, {model_class}

model = {model_class}.from_pretrained("{repo_id}")
processor = AutoProcessor.from_pretrained("{repo_id}")
hf_switchback.prepare_for_inference(model)  # optional: int8 weights quantized once
```

With plain transformers, the same repo loads as a standard 16-bit {model_class} (transformers logs
"Unknown quantization type, got switchback ... we will skip the quantization"):

```python
from transformers import AutoProcessor, {model_class}

model = {model_class}.from_pretrained("{repo_id}")
processor = AutoProcessor.from_pretrained("{repo_id}")
```
"""


def _plain_usage(repo_id: str, model_class: str) -> str:
    return f"""## Usage

config.json holds no quantization_config: the repo loads as a standard 16-bit {model_class}, with or
without `hf_switchback` (`hf_switchback.apply_switchback(model)` turns SwitchBack on again for training):

```python
from transformers import AutoProcessor, {model_class}

model = {model_class}.from_pretrained("{repo_id}")
processor = AutoProcessor.from_pretrained("{repo_id}")
```
"""


def _check_model(model: nn.Module, switchback_config: SwitchBackConfig) -> None:
    """Reject what would publish a wrong config.json / card, before anything is created on the Hub."""
    if not hasattr(model, "save_pretrained"):
        raise TypeError(
            f"push_to_hub needs a transformers PreTrainedModel, got {type(model).__name__} "
            "(unwrap it first, e.g. accelerator.unwrap_model(model))"
        )
    used = {m.switchback_config for m in switchback_modules(model).values()}
    if used - {switchback_config}:
        raise ValueError(
            f"push_to_hub: switchback_config={switchback_config} differs from the config of the model's "
            f"SwitchBack layers {sorted(map(str, used))}; the model card and config.json would be wrong"
        )


def save_for_hub(
    model: nn.Module,
    processor: Any,
    folder: str | os.PathLike,
    repo_id: str,
    *,
    switchback_config: SwitchBackConfig,
    training_args: Mapping[str, Any],
    metrics: Mapping[str, Any],
    plain: bool = False,
) -> list[str]:
    """Write what push_to_hub uploads into `folder`; returns the file names written (sorted).

    config.json carries SwitchBack's quantization_config (the model reloads as SwitchBack under hf_switchback,
    as a plain model elsewhere); plain=True leaves it out (a plain model everywhere)."""
    _check_model(model, switchback_config)
    folder = os.fspath(folder)
    model.save_pretrained(folder)
    if processor is not None:
        processor.save_pretrained(folder)
    # The same config.json rule as train_clip's --output_dir: SwitchBack's quantization_config unless `plain`.
    if plain:
        strip_quantization_config(folder)
    else:
        write_quantization_config(folder, switchback_config)
    base_model = getattr(getattr(model, "config", None), "name_or_path", None)
    card = model_card(
        repo_id,
        switchback_config=switchback_config,
        training_args=training_args,
        metrics=metrics,
        base_model=base_model,
        model_class=type(model).__name__,
        plain=plain,
    )
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)
    return sorted(os.listdir(folder))


def push_to_hub(
    model: nn.Module,
    processor: Any,
    repo_id: str,
    *,
    switchback_config: SwitchBackConfig,
    training_args: dict,
    metrics: dict,
    private: bool = False,
    token: str | None = None,
    plain: bool = False,
) -> str:
    """Create (or reuse) the Hub repo `repo_id` and upload model + processor + model card in one commit.

    model: an unwrapped transformers model (SwitchBack layers or plain); processor: anything with
    save_pretrained (CLIPProcessor), or None. `token`: default HF_TOKEN or the cached login. Returns the
    repo URL. plain: config.json without quantization_config (see save_for_hub).
    """
    _check_model(model, switchback_config)
    api = HfApi(token=resolve_token(token))
    # Create before serializing: a bad token or name fails before any work.
    repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hf_switchback_push_") as folder:
        save_for_hub(
            model,
            processor,
            folder,
            repo_url.repo_id,
            switchback_config=switchback_config,
            training_args=training_args,
            metrics=metrics,
            plain=plain,
        )
        api.upload_folder(
            repo_id=repo_url.repo_id,
            folder_path=folder,
            commit_message=f"Upload SwitchBack ({switchback_config.variant}) {type(model).__name__}",
        )
    return str(repo_url)


__all__ = ["model_card", "push_to_hub", "resolve_token", "save_for_hub"]
