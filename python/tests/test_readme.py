"""The README's Python quick start runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_quick_start_runs(tmp_path, monkeypatch, capsys):
    text = README.read_text()
    section = text.split("\n## Python\n", 1)
    assert len(section) == 2, "README has no '## Python' section"
    blocks = re.findall(r"```python\n(.*?)```", section[1].split("\n## ", 1)[0], re.S)
    assert blocks, "the README's Python section has no python block"
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    assert "delivered" in capsys.readouterr().out


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
