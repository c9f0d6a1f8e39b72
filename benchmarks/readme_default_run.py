"""The README's figures of the default training run, regenerated from a real run instead of copied by hand.

    python benchmarks/readme_default_run.py                       # launch the default run, then rewrite
    python benchmarks/readme_default_run.py --results runs/clip_switchback/all_results.json   # an earlier run

The record (the run's figures, the machine, the date) goes to docs/figures/default_run.json and the sentence made from
it into README.md between the `<!-- default-run -->` markers; tests/test_readme.py checks that the two agree.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "docs" / "figures" / "default_run.json"
README = REPO / "README.md"
MARKERS = re.compile(r"(<!-- default-run -->)(.*?)(<!-- /default-run -->)", re.DOTALL)


def record_from(results: dict, wall_seconds: float | None) -> dict:
    """What the README sentence needs from a run's all_results.json, plus the machine it ran on."""
    from hf_switchback.training import synthetic

    return {
        "train_steps": results["train_steps"],
        "global_batch_size": results["global_batch_size"],
        # the launch's wall time when measured here, else training time alone (evals and saving left out)
        "seconds": wall_seconds
        or results["global_batch_size"] * results["train_steps"] / results["train_samples_per_second"],
        "zero_shot_top1": results["zero_shot_top1"],
        "image_to_text_R@1": results["image_to_text_R@1"],
        "text_to_image_R@1": results["text_to_image_R@1"],
        "zero_shot_classes": len(synthetic.zeroshot_classnames()),
        "eval_samples": results["eval_samples"],
        "cpu_count": os.cpu_count(),
        # other jobs on the machine stretch the time: a load above the core count is said in the sentence
        "load_average": round(os.getloadavg()[1], 1),
        "date": datetime.date.today().isoformat(),
    }


def sentence(record: dict) -> str:
    """The README's words for a record."""
    shared = record["load_average"] > record["cpu_count"]
    machine = f"{record['cpu_count']}-core CPU" + (
        f" shared with other jobs (load {record['load_average']:.0f})" if shared else ""
    )
    return (
        f"on a {machine}, {record['train_steps']} steps x {record['global_batch_size']} pairs "
        f"in about {record['seconds'] / 60:.1f} minutes, zero-shot top-1 {record['zero_shot_top1']:.1%} "
        f"(chance {1 / record['zero_shot_classes']:.1%}), image→text R@1 {record['image_to_text_R@1']:.1%}, "
        f"text→image R@1 {record['text_to_image_R@1']:.1%} (chance {1 / record['eval_samples']:.1%}; "
        f"measured {record['date']})"
    )


def readme_sentence(text: str) -> str:
    """The sentence between the markers, whitespace joined (the README wraps it)."""
    found = MARKERS.search(text)
    if found is None:
        raise ValueError("README.md has no <!-- default-run --> ... <!-- /default-run --> markers")
    return " ".join(found.group(2).split())


def rewrite(text: str, record: dict) -> str:
    readme_sentence(text)  # the markers must be there
    wrapped = textwrap.fill(sentence(record), width=110)
    return MARKERS.sub(lambda m: f"{m.group(1)}\n{wrapped}\n{m.group(3)}", text, count=1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", help="all_results.json of a default run (default: launch one now).")
    parser.add_argument("--seconds", type=float, help="With --results: that launch's wall time.")
    args = parser.parse_args()
    wall = args.seconds
    if args.results:
        results_path = Path(args.results)
    else:
        out = Path(tempfile.mkdtemp(prefix="default_run_"))
        start = time.perf_counter()
        command = ["accelerate", "launch", str(REPO / "examples" / "train_clip.py"), "--output_dir", str(out)]
        subprocess.run(command, check=True)
        wall = time.perf_counter() - start
        results_path = out / "all_results.json"
    record = record_from(json.loads(results_path.read_text()), wall)
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    README.write_text(rewrite(README.read_text(), record))
    print(sentence(record), file=sys.stderr)


if __name__ == "__main__":
    main()
