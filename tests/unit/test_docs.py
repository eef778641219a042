"""The README stays in step with the code: config keys and the test command CI runs."""

from __future__ import annotations

import re

from conftest import ROOT

from shardtune.config import SECTIONS

README = (ROOT / "README.md").read_text()


def test_config_reference_lists_every_key():
    documented = set(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", README, flags=re.MULTILINE))
    actual = {f"{section}.{field.alias or name}" for section, model in SECTIONS.items()
              for name, field in model.model_fields.items()}
    assert documented == actual


def test_ci_runs_the_readme_test_command():
    command = "ruff check . && python -m pytest -q"
    assert f"```bash\n{command}\n```" in README
    assert command in (ROOT / ".ci" / "run").read_text()
