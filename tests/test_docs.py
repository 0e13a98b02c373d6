"""The Python blocks of every page in docs/ run as shown: each on its own, in a fresh interpreter
(forked from one that has imported torch and qtensor: `fresh.py`), in a scratch directory (a block
that writes a file writes it there)."""

import pathlib
import re

import pytest
from fresh import run_python

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BLOCKS = [
    (page.name, index, block)
    for page in sorted(DOCS.glob("*.md"))
    for index, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
]


def test_every_topic_page_exists_and_has_examples():
    pages = {page.name for page in DOCS.glob("*.md")}
    topics = {"formats.md", "recipes.md", "fsdp2.md", "checkpoints.md", "performance.md", "compile.md", "limitations.md", "activation-memory.md"}
    assert topics <= pages
    with_code = {name for name, _, _ in BLOCKS}
    assert topics - {"performance.md", "limitations.md"} <= with_code


def test_every_linked_page_exists():
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+\.(?:md|png))\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


@pytest.mark.parametrize("page,index,block", BLOCKS, ids=[f"{name}-{index}" for name, index, _ in BLOCKS])
def test_each_docs_block_runs_on_its_own(page, index, block, tmp_path):
    done = run_python(block, cwd=tmp_path)  # qtensor importable as from the repository root, whatever the cwd
    assert done.returncode == 0, f"{page} block {index} failed on its own:\n{block}\n{done.stderr[-3000:]}"
