"""The README's Python quick start runs as written, twice in a row (as a user runs it again),
and needs nothing that the README's install line does not install."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def python_section() -> str:
    text = README.read_text()
    section = text.split("\n## Python\n", 1)
    assert len(section) == 2, "README has no '## Python' section"
    return section[1].split("\n## ", 1)[0]


def quick_start() -> list:
    blocks = re.findall(r"```python\n(.*?)```", python_section(), re.S)
    assert blocks, "the README's Python section has no python block"
    return blocks


def test_the_readme_quick_start_runs_and_runs_again(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for run in range(2):
        for code in quick_start():
            exec(compile(code, str(README), "exec"), {"__name__": "readme"})
        assert "delivered" in capsys.readouterr().out, f"run {run + 1}"


@pytest.mark.skipif(sys.version_info < (3, 10), reason="sys.stdlib_module_names is 3.10's")
def test_the_install_line_installs_what_the_quick_start_imports():
    installs = re.findall(r"^pip install (.*?)(?:\s+#.*)?$", python_section(), re.M)
    assert installs, "the README's Python section has no pip install line"
    named = set(installs[0].split())
    for code in quick_start():
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "gpufeed":
                    continue
                assert top in named, f"the quick start imports {top}; `pip install {installs[0]}` does not install it"


def test_the_readme_token_example_on_the_host_runs(tmp_path, monkeypatch, capsys):
    """The token section's host example (it writes the token file it reads); the GPU example
    beside it reads data of its own and is not run here."""
    text = README.read_text()
    section = text.split("\n## Token streams for language models\n", 1)
    assert len(section) == 2, "README has no '## Token streams for language models' section"
    blocks = re.findall(r"```python\n(.*?)```", section[1].split("\n## ", 1)[0], re.S)
    host = [code for code in blocks if 'device="cuda"' not in code]
    assert len(host) == 1, "the README's token section has no host example"
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # and again, over the file it wrote the first time
        exec(compile(host[0], str(README), "exec"), {"__name__": "readme"})
        assert "delivered" in capsys.readouterr().out
