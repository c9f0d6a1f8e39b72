"""A train_clip.py run from start to end, around the training step: one writer per output directory, console
output and logging, the scalars it reports (reduced over ranks), what it tells the outside (tracker config,
final config.json, Hub upload), and an end that does not hang a distributed run.
"""

from __future__ import annotations

import dataclasses
import fcntl
import gc
import json
import logging
import os
import socket
import sys
import time
import weakref

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

# One writer per output directory: the training process holds an advisory lock on <output_dir>/.train.lock.
# Two processes writing one output_dir (a resume started while a killed launcher's training child still runs)
# delete each other's temporary checkpoints and interleave the log. The lock is an flock on an open file, so
# the kernel drops it when its holder exits in any way, kill -9 included: a lock left by a dead process is
# free to take, with no pid liveness guessing. The file keeps the holder's pid and host, for the refusal
# message; it is never deleted (removing a locked file would let a third process lock a new file beside the
# old lock). flock is advisory and local to a host on some network file systems: it guards against the common
# accident, not against a determined second writer on another machine.

LOCK_NAME = ".train.lock"


class OutputDirBusy(RuntimeError):
    """Another live process holds the output directory's lock."""


class OutputDirLock:
    """Held from acquire() to release() (or the process's exit). Use as a context manager."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_NAME)
        self._file = None

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 (held open: the open file description is the lock)
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _describe(f.read())
            f.close()
            raise OutputDirBusy(
                f"{os.path.dirname(self.path)} is being written by another training process ({holder}): wait "
                "for it to end or stop it (kill -9 of `accelerate launch` leaves its training processes "
                "running), or use another --output_dir"
            ) from None
        f.seek(0)
        f.truncate()
        json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.truncate(0)  # a reader must not name a process that no longer writes here
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> OutputDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"


# Console output that leaves the tqdm progress bar intact, and plain lines where there is no terminal. The bar
# redraws its line with a carriage return and no newline, so a plain print() or logging.StreamHandler lands on
# the bar's line in a terminal (`...samples_per_s=379]step 100: image_to_text_R@1 ...`). tqdm.write clears the
# bar, writes the line, and redraws the bar below it. When stderr is a file (every cluster job) the redraws
# would pile up as carriage-return noise, so the bar becomes one plain line every --logging_steps, as OpenCLIP
# and Trainer log.

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


# Scalars a training run reports, reduced over ranks: loss means, counts, peak CUDA memory, logit scale.


def mean_over_ranks(accelerator, value: float) -> float:
    return accelerator.reduce(torch.tensor(float(value), device=accelerator.device), reduction="mean").item()


def sum_over_ranks(accelerator, value: int) -> int:
    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), reduction="sum").item())


def peak_memory(accelerator) -> dict:
    """Peak CUDA memory of this launch, GiB: the largest rank's, and every rank's; empty without CUDA."""
    if accelerator.device.type != "cuda":
        return {}
    stats = torch.tensor(
        [
            torch.cuda.max_memory_allocated(accelerator.device),
            torch.cuda.max_memory_reserved(accelerator.device),
        ],
        dtype=torch.float64,
        device=accelerator.device,
    )
    per_rank = accelerator.gather(stats[None]).cpu() / 2**30  # (num_processes, 2)
    return {
        "peak_memory_allocated_gib": round(per_rank[:, 0].max().item(), 3),
        "peak_memory_reserved_gib": round(per_rank[:, 1].max().item(), 3),
        "peak_memory_allocated_gib_per_rank": [round(v, 3) for v in per_rank[:, 0].tolist()],
    }


def _full_value(param):
    value = param.detach()
    if hasattr(value, "full_tensor"):  # FSDP2 keeps it as a (sharded) DTensor between forwards
        value = value.full_tensor()
    return value.float().reshape(-1)[0]


def logit_scale_value(clip) -> float:
    """exp(logit_scale) of a CLIPModel / SiglipModel, also when FSDP2 holds it as a sharded DTensor."""
    return _full_value(clip.logit_scale).exp().item()


def logit_bias_value(model) -> float:
    """A SiglipModel's logit_bias, also when FSDP2 holds it as a sharded DTensor."""
    return _full_value(model.logit_bias).item()


# What the run tells the outside: the tracker's run config, the final config.json and the Hub upload.


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


# Ending a distributed run: free the prepared model before the process group, so exit does not hang on gloo.
#
# DDP's Reducer holds a reference to the process group. When the Reducer is that group's last holder (the
# group already destroyed by `accelerator.end_training()`, the model freed only when the training function
# returns), the group's destructor runs inside the Reducer's deallocation with the GIL held and joins gloo's
# worker threads. A worker that is still releasing the tensors of the last collective needs the GIL to drop
# their Python references, so both wait forever. Seen once in CI (one rank of a 2-process CPU run hung after
# the results were written; gdb: main thread in ~ProcessGroupGloo via Reducer dealloc, a pt_gloo_runloop
# thread waiting for the GIL in ~AsyncBarrierWork). PyTorch tracks this class of deadlock in
# pytorch/pytorch#56297.
#
# Two measures, since `destroy_process_group` itself also drops the group's last native reference with the GIL
# held (`_unregister_all_process_groups`), and `shutdown()` does not stop gloo's worker threads (checked on
# torch 2.13): free the model first, so the Reducer never holds the last reference; and after a final barrier,
# wait briefly without the GIL, so the workers finish releasing the last collectives' tensors while nothing
# blocks them. The wait makes the race very unlikely rather than impossible (a worker starved of CPU for the
# whole wait could still be late); only a PyTorch fix removes it.

STILL_REFERENCED = "the prepared model is still referenced when the process group is destroyed"
# GIL-free pause after the last barrier: a worker waiting for the GIL gets it at once, and thread scheduling
# delays are typically milliseconds (not measured on the CI machine)
WORKER_DRAIN_S = 0.2


def end_training(accelerator: Accelerator, model_ref: weakref.ref | None = None) -> None:
    """`accelerator.end_training()` after dropping the accelerator's references to what it prepared.

    The caller drops its own references first and passes a weak reference to the prepared model: if something
    still holds the model, a warning says so (the exit may then hang as described above).
    """
    distributed = accelerator.num_processes > 1
    if distributed:
        accelerator.wait_for_everyone()
        time.sleep(WORKER_DRAIN_S)  # releases the GIL
    accelerator.free_memory()  # its own models, optimizers, schedulers, dataloaders (and a first gc pass)
    gc.collect()  # DDP and its hooks form reference cycles; the pass above ran while accelerator still held them
    if distributed and model_ref is not None and model_ref() is not None:
        referrers = [type(r).__name__ for r in gc.get_referrers(model_ref())]
        logger.warning("%s (held by %s): the process may hang on exit", STILL_REFERENCED, referrers)
    accelerator.end_training()
