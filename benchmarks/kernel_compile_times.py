"""Each Triton kernel of a compiled run, compiled again one after another in one process: its own compile time.

compile_warmup.py --cache_root DIR keeps each row's Inductor cache (DIR/<model>_<variant>/repeat0/inductor), where
Inductor wrote every Triton kernel it compiled as a Python module. This loads each module and times torch's own
`CachingAutotuner.precompile` of it (what a compile worker does for the kernel: every autotuning config through
Triton) on an empty Triton cache, with nothing else running. A worker's record of the same kernel
(bench_train.py's `first_step_kernel_compiles`) adds the host's load; where the two agree, fewer or more workers
cannot shorten a graph's wait, only kernels that compile faster can (BENCHMARKS.md, compile warm-up).

    PYTHONPATH=src python benchmarks/compile_warmup.py --models vit-b-16 --variants int8+compile \\
        --compile layers --steps 1 --warmup 0 --no_prime --cache_root /tmp/cw
    PYTHONPATH=src python benchmarks/kernel_compile_times.py /tmp/cw/vit-b-16_int8_compile/repeat0/inductor \\
        --json $OUT/kernels.json

No GPU is touched: each module names its target (e.g. sm90), for which Triton's CUDA backend compiles. On a
machine without a GPU, --no_gpu skips torch's check for an active one (the same kernels, this host's CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import types
from pathlib import Path

# A kernel module holds one @triton.jit function under Inductor's decorator; a graph's module calls async_compile.
_KERNEL_DEF = re.compile(r"@triton\.jit\s*\ndef (\w+)\(")


def kernel_sources(root: Path) -> list[tuple[str, Path]]:
    """(kernel name, module file) of every Triton kernel module under an Inductor cache folder, by name."""
    found = []
    for path in sorted(Path(root).rglob("*.py")):
        text = path.read_text(errors="replace")
        if "triton_heuristics." not in text or "async_compile" in text:
            continue
        match = _KERNEL_DEF.search(text)
        if match:
            found.append((match.group(1), path))
    return sorted(found)


def compile_time(name: str, path: Path) -> dict:
    """Seconds to load the kernel's module and to compile every autotuning config of it (the Triton cache
    folder is the caller's: empty for a first compile)."""
    start = time.perf_counter()
    module = types.ModuleType(path.stem)
    module.__file__ = str(path)  # Inductor's decorator records it
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)  # a module Inductor wrote
    kernel = getattr(module, name)
    loaded = time.perf_counter()
    configs = len(kernel.configs)  # precompile drops the list
    kernel.precompile(warm_cache_only=True)
    done = time.perf_counter()
    return dict(
        kernel=name,
        file=path.name,
        configs=configs,
        load_s=round(loaded - start, 3),
        s=round(done - loaded, 3),
    )


def compile_all(sources: list[tuple[str, Path]], no_gpu: bool = False) -> list[dict]:
    """compile_time of each kernel, one after another, on a new Triton cache that is removed afterwards (this
    process's own cache folder and driver check are restored)."""
    from torch._inductor.runtime import triton_helpers
    from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path

    _set_triton_ptxas_path()  # the ptxas torch's workers use
    previous_dir, previous_check = os.environ.get("TRITON_CACHE_DIR"), triton_helpers.set_driver_to_gpu
    with tempfile.TemporaryDirectory(prefix="kernel_compile_times_") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        if no_gpu:  # the target comes from each module, not from a device
            triton_helpers.set_driver_to_gpu = lambda: None
        try:
            return [compile_time(name, path) for name, path in sources]
        finally:
            triton_helpers.set_driver_to_gpu = previous_check
            if previous_dir is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = previous_dir


def print_table(rows: list[dict], top: int) -> None:
    total = sum(row["s"] for row in rows)
    print(
        f"{len(rows)} kernels, {total:.2f} s compiling one after another; the slowest {min(top, len(rows))}:"
    )
    print(f"{'s':>6} {'configs':>7}  kernel")
    for row in sorted(rows, key=lambda r: -r["s"])[:top]:
        print(f"{row['s']:6.2f} {row['configs']:7d}  {row['kernel']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("inductor_cache", type=Path, help="a row's Inductor cache folder (see above)")
    parser.add_argument("--top", type=int, default=20, help="rows printed, slowest first")
    parser.add_argument("--json", type=Path, help="also write every kernel's row here")
    parser.add_argument(
        "--no_gpu", action="store_true", help="compile on a machine without a GPU (see above)"
    )
    args = parser.parse_args(argv)
    if not args.inductor_cache.is_dir():
        parser.error(
            f"{args.inductor_cache} is not a folder: pass a row's cache, e.g. DIR/<model>_<variant>/repeat0/inductor"
        )
    sources = kernel_sources(args.inductor_cache)
    rows = compile_all(sources, args.no_gpu) if sources else []
    print_table(rows, args.top)
    if args.json:
        args.json.write_text(json.dumps(dict(inductor_cache=str(args.inductor_cache), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
