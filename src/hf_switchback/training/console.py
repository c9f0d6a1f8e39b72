"""Console output that leaves the tqdm progress bar intact.

The bar redraws its line with a carriage return and no newline, so a plain print() or logging.StreamHandler
lands on the bar's line in a terminal (`...samples_per_s=379]step 100: image_to_text_R@1 ...`). tqdm.write
clears the bar, writes the line, and redraws the bar below it.
"""

from __future__ import annotations

import logging
import sys

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


def console(accelerator, message: str) -> None:
    """Print `message` to stdout once per machine (like accelerator.print), above the progress bar."""
    if accelerator.is_local_main_process:
        tqdm.write(message)
