"""The README stays in step with the code: config keys and the test command CI runs."""

from __future__ import annotations

import re

from conftest import ROOT

from shardtune.config import SECTIONS

README = (ROOT / "README.md").read_text()


def test_config_reference_lists_every_key():
    documented = set(re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \|", README, flags=re.MULTILINE))
    actual = {f"{section}.{field.alias or name}" for section, model in SECTIONS.items()
              for name, field in model.model_fields.items()}
    assert documented == actual


def test_ci_runs_the_readme_test_command():
    command = "ruff check . && python -m pytest -q"
    assert f"```bash\n{command}\n```" in README
    assert command in (ROOT / ".ci" / "run").read_text()


def test_every_readme_train_command_has_its_own_output_dir():
    """The LoRA command once reused runs/tiny and overwrote the full fine-tune's checkpoints and summary."""
    import shlex

    from shardtune.config import load_config

    seen: dict[str, str] = {}
    for line in re.findall(r"shardtune train (examples/[^`\n#]+)", README):
        if "learning_rate" in line:  # the README's example of a refused key, not a run
            continue
        args = shlex.split(line)
        out = next((args[i + 1] for i, a in enumerate(args) if a == "--output-dir"), None)
        out = out or next((a.split("=", 1)[1] for a in args if a.startswith("train.output_dir=")), None)
        if out is None:  # the example's own, relative to its folder
            out = str(load_config(ROOT / args[0], [a for a in args[1:] if "=" in a and not a.startswith("-")])
                      .train.output_dir)
            out = str((ROOT / out).resolve().relative_to(ROOT))
        assert out not in seen, f"{line!r} writes {out}, as {seen[out]!r} does"
        seen[out] = line
    assert len(seen) >= 6 and "runs/tiny" in seen and "runs/tiny-lora" in seen
