"""What a train_clip.py run tells the outside: the tracker's run config and the Hub upload of the final model."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def public_args(args) -> dict:
    """The run's flags as a dict, without the Hub token (it must never reach logs or a model card)."""
    return {k: v for k, v in vars(args).items() if k != "hub_token"}


def tracker_config(args) -> dict:
    """The flags as a tracker config: trackers accept scalars only, so everything else becomes its str()."""
    return {
        k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in public_args(args).items()
    }


def push_model(model, processor, args, sb_config, metrics) -> None:
    """--push_to_hub: the final CLIPModel, its processor and a model card to --hub_model_id."""
    from ..hub import push_to_hub  # imported here: only --push_to_hub needs huggingface_hub's upload path

    url = push_to_hub(
        model,
        processor,
        args.hub_model_id,
        switchback_config=sb_config,
        training_args=public_args(args),
        metrics=metrics,
        private=args.hub_private,
        token=args.hub_token,
    )
    logger.info("pushed to %s", url)
