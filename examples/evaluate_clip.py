"""Zero-shot accuracy and image<->text retrieval recall of any CLIP or SigLIP checkpoint, without training.

The numbers come from the `evaluate` metrics shipped in the package (hf_switchback/metrics, loaded by path, so
this runs offline) through the same code as train_clip.py's evaluation, and are written with evaluate.save:

    # a train_clip.py run (SwitchBack layers restored from its config.json) on the embedded synthetic eval set:
    python examples/evaluate_clip.py --model_name_or_path runs/clip_switchback

    # any checkpoint on your own captions; zero-shot needs a label column and the class names:
    python examples/evaluate_clip.py --model_name_or_path openai/clip-vit-base-patch32 \\
        --validation_file val.csv --zeroshot_label_column label --zeroshot_classnames cat,dog,bird
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_switchback import metrics
from hf_switchback.training.cli import build_parser
from hf_switchback.training.evaluation import evaluate
from hf_switchback.training.model_setup import load_model_and_processor
from hf_switchback.training.sources import load_eval_set


def eval_args(args) -> argparse.Namespace:
    """train_clip.py's flags with their defaults, set to this evaluation: the eval data is the only data."""
    train_args = build_parser().parse_args([])
    for name, value in vars(args).items():
        setattr(train_args, name, value)
    # load_eval_set reads a --validation_file only in a run with data of its own (else: the synthetic set)
    train_args.train_file = args.validation_file
    return train_args


def evaluate_checkpoint(args) -> dict:
    """Load the checkpoint and the eval set, run the metrics, save them; returns the metrics."""
    train_args = eval_args(args)
    model, processor = load_model_and_processor(train_args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    eval_set, classnames, templates = load_eval_set(train_args, None)
    results = evaluate(
        model,
        processor.tokenizer,
        processor.image_processor,
        eval_set,
        classnames=classnames,
        templates=templates,
        max_length=min(args.max_text_length, model.config.text_config.max_position_embeddings),
        device=device,
        batch_size=args.batch_size,
    )
    metrics.save(args.output_file, results)
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model_name_or_path", required=True, help="A CLIP / SigLIP checkpoint: Hub id or folder."
    )
    parser.add_argument(
        "--validation_file", help="CSV / JSON of image paths and captions (default: the synthetic eval set)."
    )
    parser.add_argument("--image_column", help="Image column of --validation_file (default: found by name).")
    parser.add_argument(
        "--caption_column", help="Caption column of --validation_file (default: found by name)."
    )
    parser.add_argument(
        "--zeroshot_label_column", help="Class-index column of --validation_file, for zero-shot."
    )
    parser.add_argument("--zeroshot_classnames", help="Comma-separated class names, in label order.")
    parser.add_argument(
        "--zeroshot_templates",
        default="a photo of a {}.",
        help="'|'-separated prompts, {} for the class name.",
    )
    parser.add_argument("--max_eval_samples", type=int, default=256, help="Image-caption pairs evaluated.")
    parser.add_argument("--max_text_length", type=int, default=77, help="Tokens per caption (truncated).")
    parser.add_argument("--batch_size", type=int, default=256, help="Pairs per forward.")
    parser.add_argument("--output_file", default="eval_results.json", help="Where evaluate.save writes them.")
    args = parser.parse_args(argv)
    results = evaluate_checkpoint(args)
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
