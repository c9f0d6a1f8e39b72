"""What a train_clip.py run tells the outside: the tracker's run config and the Hub upload of the final model."""

from __future__ import annotations

import dataclasses
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
    """--push_to_hub: the final CLIPModel, its processor and a model card to --hub_model_id, with the same
    config.json as --output_dir's (save_final_config)."""
    from ..hub import push_to_hub  # imported here: only --push_to_hub needs huggingface_hub's upload path

    url = push_to_hub(
        model,
        processor,
        args.hub_model_id,
        switchback_config=sb_config,
        training_args=public_args(args),
        metrics={
            k: v for k, v in metrics.items() if k != "switchback"
        },  # the card has its own config section
        private=args.hub_private,
        plain=saves_plain(args, sb_config),
        token=args.hub_token,
    )
    logger.info("pushed to %s", url)


def saves_plain(args, sb_config) -> bool:
    """Whether the final model is saved and pushed without SwitchBack's quantization_config."""
    return sb_config is None or args.save_plain


def save_final_config(output_dir: str, args, sb_config) -> None:
    """The one config.json rule for the saved and the pushed model: SwitchBack's quantization_config (the
    model reloads as SwitchBack under hf_switchback, as a plain CLIPModel elsewhere), unless --save_plain or
    --switchback off (a plain CLIPModel everywhere)."""
    from ..quantizer import strip_quantization_config, write_quantization_config

    if saves_plain(args, sb_config):
        strip_quantization_config(output_dir)
    else:
        write_quantization_config(output_dir, sb_config)


def switchback_results(sb_config) -> dict | None:
    """all_results.json's `switchback`: the config as config.json has it, plus the kernel options that ran
    (to_dict leaves them out of config.json: they are this process's choice, not the model's)."""
    if sb_config is None:
        return None
    return {**sb_config.to_dict(), "kernel_options": dataclasses.asdict(sb_config.kernel_options)}
