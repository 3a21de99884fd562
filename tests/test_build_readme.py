"""The CI recipe in README.md runs: every `cortex` command in its block, through the installed
script, on a sample model, in the order written (so the README cannot drift from the CLI)."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

from cli_helpers import run_cli
from testdata import SAMPLES_DIR

README = Path(__file__).resolve().parent.parent / "README.md"


def recipe_commands() -> list[list[str]]:
    text = README.read_text()
    block = re.search(r"<!-- ci-recipe -->\s*```yaml\n(.*?)```", text, re.DOTALL)
    assert block, "README.md has no <!-- ci-recipe --> yaml block"
    lines = [m.group(1) for m in re.finditer(r"^\s*- run: (.*?)\s*(?:#.*)?$", block.group(1), re.MULTILINE)]
    return [shlex.split(line) for line in lines if line.startswith("cortex ")]


def test_the_readme_ci_recipe_builds_checks_and_verifies(tmp_path):
    commands = recipe_commands()
    assert [argv[1] for argv in commands] == ["build", "build", "verify"]
    assert "--check" in commands[1]
    shutil.copy(SAMPLES_DIR / "cnn.onnx", tmp_path / "model.onnx")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    for argv in commands:
        code, _, err = run_cli(argv[1:], cwd=tmp_path, env=env)
        assert code == 0, f"{shlex.join(argv)}: {err}"
    assert (tmp_path / "out" / "build.json").is_file()
    # the check step is a real gate: a changed model fails it
    (tmp_path / "model.onnx").write_bytes((SAMPLES_DIR / "mlp.onnx").read_bytes())
    code, _, err = run_cli(commands[1][1:], cwd=tmp_path, env=env)
    assert code == 1 and "model.onnx changed" in err
