"""The main job runs end to end and prints its table."""

from qtensor import demo


def test_demo_trains_every_recipe_and_prints_the_table(capsys):
    demo.main(["--steps", "4", "--d-model", "32", "--layers", "1", "--batch", "4", "--length", "32"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("recipe"))
    for column in ("final loss", "gap to bf16", "weight KiB", "step ms"):
        assert column in header
    names = [run.name for run in demo.demo_runs()]
    assert "mxfp8_fwd_nvfp4_bwd" in names and any("high_precision" in n for n in names) and any("dequantized" in n for n in names)
    for name in names:
        assert any(line.startswith(name) for line in out.splitlines()), name
    # every quantized run saved, reloaded into a fresh model, and its logits compared
    rows = [line for line in out.splitlines() if line.startswith(tuple(names)) and not line.startswith("bf16")]
    assert rows and all(line.endswith("identical") for line in rows), rows
    assert f"identical in {len(rows)} of {len(rows)} runs" in out


def test_formats_table_lists_every_format(capsys):
    demo.main(["--formats"])
    out = capsys.readouterr().out
    for name in ("float8", "mxfp8", "nvfp4", "identity", "hybrid"):
        assert name in out


def test_a_training_step_of_every_recipe_runs_no_op_on_dequantized_values():
    """qtensor.fallbacks('raise'): the quantized path of the main job's model has no fallback."""
    import copy

    import torch

    import qtensor

    torch.manual_seed(0)
    base = demo.TinyLM(len(demo.VOCABULARY), 32, 1, 4, 32)
    for run in demo.demo_runs()[1:]:
        model = copy.deepcopy(base)
        qtensor.quantize_(model, run.recipe, weights=run.weights)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if run.weights == "quantized":
            optimizer = qtensor.optim.MasterWeights(optimizer)
        tokens = demo.sums_stream(4, 16, torch.Generator().manual_seed(0))
        with qtensor.fallbacks("raise"):
            demo.train_step(model, optimizer, tokens)
