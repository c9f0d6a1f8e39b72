"""Console output that leaves the tqdm progress bar intact, and plain lines where there is no terminal.

The bar redraws its line with a carriage return and no newline, so a plain print() or logging.StreamHandler
lands on the bar's line in a terminal (`...samples_per_s=379]step 100: image_to_text_R@1 ...`). tqdm.write
clears the bar, writes the line, and redraws the bar below it. When stderr is a file (every cluster job) the
redraws would pile up as carriage-return noise, so the bar becomes one plain line every --logging_steps, as
OpenCLIP and Trainer log.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

from tqdm.auto import tqdm

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TqdmLoggingHandler(logging.Handler):
    """A logging handler that writes each record to stderr through tqdm.write."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def setup_logging(main_process: bool) -> None:
    """Root logging through tqdm.write: INFO on the main process, WARNING on the others. Like basicConfig, it
    leaves a root logger that already has handlers alone."""
    handler = TqdmLoggingHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    if not main_process:
        logging.getLogger().setLevel(logging.WARNING)
    if not sys.stderr.isatty():
        # the libraries' own bars (model shards, data set maps) would write carriage-return noise to the file
        import datasets
        import huggingface_hub
        from transformers.utils import logging as hf_logging

        datasets.disable_progress_bars()
        huggingface_hub.utils.disable_progress_bars()
        hf_logging.disable_progress_bar()


def console(accelerator, message: str) -> None:
    """Print `message` to stdout once per machine (like accelerator.print), above the progress bar."""
    if accelerator.is_local_main_process:
        tqdm.write(message)


class PlainProgress:
    """tqdm's update / set_postfix / close for a stderr that is not a terminal: one line every `every` steps
    and at the last, `step 100/781 (13%) loss=3.120 samples_per_s=380 elapsed 45s`."""

    def __init__(self, total: int, initial: int = 0, every: int = 1, disable: bool = False) -> None:
        self.total, self.n, self.every, self.disable = total, initial, max(1, every), disable
        self.postfix: dict[str, str] = {}
        self.start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, **values) -> None:
        self.postfix = {k: str(v) for k, v in values.items()}
        if not self.disable and (self.n % self.every == 0 or self.n == self.total):
            fields = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            elapsed = time.perf_counter() - self.start
            percent = 100 * self.n // max(1, self.total)
            print(f"step {self.n}/{self.total} ({percent}%) {fields} elapsed {elapsed:.0f}s", file=sys.stderr)

    def close(self) -> None:
        pass


def progress_bar(total: int, initial: int, every: int, disable: bool):
    """A tqdm bar on a terminal, else PlainProgress (a line every `every` steps)."""
    if sys.stderr.isatty():
        return tqdm(total=total, initial=initial, disable=disable)
    return PlainProgress(total, initial, every, disable)


def format_config(config) -> str:
    """A dataclass config as aligned `field  value` lines (nested dataclasses: `name=value, ...` on one line)."""
    rows = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            value = ", ".join(f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value))
        rows.append((field.name, value))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


# The final summary line: the figures a run is judged by (the full set stays in all_results.json).
SUMMARY_KEYS = (
    "zero_shot_top1",
    "image_to_text_R@1",
    "text_to_image_R@1",
    "train_loss",
    "train_samples_per_second",
    "nonfinite_skipped_steps",
)


def summary_line(results: dict) -> str:
    """`done: 781 steps, zero_shot_top1 0.984, ...` from a run's results."""
    fields = [f"{k} {results[k]:.4g}" for k in SUMMARY_KEYS if isinstance(results.get(k), (int, float))]
    return f"{results.get('status', 'done')}: {results.get('train_steps')} steps, " + ", ".join(fields)
