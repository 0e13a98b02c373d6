"""The README's Python examples run as shown: each on its own, in a fresh interpreter (forked from
one that has imported torch and qtensor: `fresh.py`)."""

import pathlib
import re

import pytest
from fresh import run_python

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 4, "README lost its python examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_each_readme_block_runs_on_its_own(index):
    done = run_python(BLOCKS[index])
    assert done.returncode == 0, f"README block {index} failed on its own:\n{BLOCKS[index]}\n{done.stderr[-3000:]}"
