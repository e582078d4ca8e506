"""CI runs README's test command: the line after the marker in .ci/run is how README's "Run the
tests" command ends, after the install (a reader who copies README's command runs what CI runs)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARKER = "# --- README test command (keep identical) ---"
INSTALL = "pip install -e '.[dev]' && "


def test_ci_runs_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    ci_command = ci[ci.index(MARKER) + 1].strip()
    section = (ROOT / "README.md").read_text().split("## Run the tests", 1)[1]
    readme_command = re.search(r"```bash\n(.*?)\n```", section, flags=re.S).group(1).strip()  # type: ignore[union-attr]
    assert INSTALL in readme_command
    assert readme_command.split(INSTALL, 1)[1] == ci_command
    assert ci_command.startswith("ruff check . && mypy && ")  # lint and types: a step of their own, first
