"""Ending a distributed run: free the prepared model before the process group, so exit does not hang on gloo.

DDP's Reducer holds a reference to the process group. When the Reducer is that group's last holder (the group
already destroyed by `accelerator.end_training()`, the model freed only when the training function returns),
the group's destructor runs inside the Reducer's deallocation with the GIL held and joins gloo's worker threads.
A worker that is still releasing the tensors of the last collective needs the GIL to drop their Python
references, so both wait forever. Seen once in CI (one rank of a 2-process CPU run hung after the results were
written; gdb: main thread in ~ProcessGroupGloo via Reducer dealloc, a pt_gloo_runloop thread waiting for the GIL
in ~AsyncBarrierWork). PyTorch tracks this class of deadlock in pytorch/pytorch#56297.

Two measures, since `destroy_process_group` itself also drops the group's last native reference with the GIL
held (`_unregister_all_process_groups`), and `shutdown()` does not stop gloo's worker threads (checked on torch
2.13): free the model first, so the Reducer never holds the last reference; and after a final barrier, wait
briefly without the GIL, so the workers finish releasing the last collectives' tensors while nothing blocks
them. The wait makes the race very unlikely rather than impossible (a worker starved of CPU for the whole wait
could still be late); only a PyTorch fix removes it.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref

from accelerate import Accelerator

logger = logging.getLogger(__name__)

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
