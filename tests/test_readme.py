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
    recipe = makefile.split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    assert "ruff check ." in recipe and "ruff format --check ." in recipe and "-m pytest -q" in recipe
