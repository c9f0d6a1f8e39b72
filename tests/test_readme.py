"""The README's checkable claims against the code: the SwitchBackConfig defaults table, and the Quick start's
test command being the one CI runs."""

import ast
import dataclasses
import re
from pathlib import Path

from hf_switchback import SwitchBackConfig

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def defaults_table() -> dict[str, str]:
    """{field: default as written} from the README's `| `field` | `default` | ... |` rows."""
    return dict(re.findall(r"^\| `(\w+)` \| `([^`]*)`", README, flags=re.MULTILINE))


def test_config_table_defaults_match_the_code():
    table = defaults_table()
    config = SwitchBackConfig()
    fields = {f.name for f in dataclasses.fields(SwitchBackConfig)}
    assert fields <= table.keys(), sorted(fields - table.keys())
    for name in fields - {"kernel_options"}:
        assert ast.literal_eval(table[name]) == getattr(config, name), name
    assert (
        table["kernel_options"] == "KernelOptions()"
        and config.kernel_options == type(config.kernel_options)()
    )


def test_quick_start_test_command_is_what_ci_runs():
    quick_start = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick_start.strip().splitlines()]
    assert commands == ["make test", "make train"]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in ci if line and not line.startswith("#")]
    assert "make test VENV=.ci/venv" in commands and not any("pytest" in c or "ruff" in c for c in commands)
    makefile = (REPO / "Makefile").read_text()

    def recipe(target: str) -> str:
        return makefile.split(f"\n{target}: ", 1)[1].split("\n\n", 1)[0]

    assert recipe("test").split() == ["test-newest", "test-lowest"]
    newest = recipe("test-newest")
    assert "ruff check ." in newest and "ruff format --check ." in newest and "-m pytest -q" in newest
    assert "-m pytest -q" in recipe("test-lowest")


def test_default_run_figures_come_from_the_recorded_run():
    """The Training section's figures are benchmarks/readme_default_run.py's sentence for the recorded run."""
    import json

    from helpers import load_script

    script = load_script("benchmarks/readme_default_run.py")
    record = json.loads(script.RECORD.read_text())
    assert script.readme_sentence(README) == script.sentence(record)


def test_default_run_rewrite_replaces_only_the_marked_sentence():
    from helpers import load_script

    script = load_script("benchmarks/readme_default_run.py")
    results = {"train_steps": 10, "global_batch_size": 4, "train_samples_per_second": 2.0, "zero_shot_top1": 0.5,
               "image_to_text_R@1": 0.25, "text_to_image_R@1": 0.125, "eval_samples": 8}  # fmt: skip
    record = script.record_from(results, None)
    assert record["seconds"] == 20.0  # 10 steps x 4 pairs at 2 pairs/s
    text = "before <!-- default-run -->old\nwrapped words<!-- /default-run --> after"
    new = script.rewrite(text, record)
    assert new.startswith("before <!-- default-run -->\non a ") and new.endswith(
        "\n<!-- /default-run --> after"
    )
    words = " ".join(new.split())  # the sentence is wrapped
    assert "zero-shot top-1 50.0% (chance 3.1%)" in words and "text→image R@1 12.5% (chance 12.5%;" in words
    assert script.readme_sentence(new) == script.sentence(record)
