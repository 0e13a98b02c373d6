"""The notebooks run as a reader would run them, and are committed with their outputs."""

import json
import pathlib

import matplotlib
import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
PLOTTING = {"01_quickstart.ipynb", "02_formats.ipynb", "04_convergence.ipynb", "05_lora.ipynb"}


def test_the_five_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_formats.ipynb", "03_checkpoints.ipynb", "04_convergence.ipynb", "05_lora.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_cells_run_in_order(path, monkeypatch):
    matplotlib.use("Agg")  # plots render off screen
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *args, **kwargs: None)
    monkeypatch.chdir(NOTEBOOK_DIR)
    namespace = {}
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), str(path), "exec"), namespace)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_with_its_outputs(path):
    """Readable on a code host without running: every code cell ran, none failed, plots are images."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in cells]
    assert counts == list(range(1, len(cells) + 1)), "run it top to bottom in a fresh kernel before committing"
    outputs = [o for c in cells for o in c["outputs"]]
    assert outputs and not any(o["output_type"] == "error" for o in outputs)
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert bool(images) == (path.name in PLOTTING)
