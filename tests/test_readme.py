"""The README's Python examples run as shown: each on its own, in a fresh interpreter."""

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 4, "README lost its python examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_each_readme_block_runs_on_its_own(index):
    done = subprocess.run([sys.executable, "-c", BLOCKS[index]], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"README block {index} failed on its own:\n{BLOCKS[index]}\n{done.stderr[-3000:]}"
