"""The README's Python examples run as shown."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run_in_order():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3, "README lost its python examples"
    namespace = {}  # one namespace, as a reader running them one after another
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
