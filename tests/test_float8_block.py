"""Float8 with block scales (row-wise, 1x128, 128x128), bit-exact against the numpy oracle written
from docs/numerics.md (Float8 with block scales), and the three recipes built on it."""

import numpy as np
import pytest
import torch
from torch import nn

import oracle
import workers
from cases import DTYPES, FP8_DTYPES, dtype_id
import qtensor

BLOCKS = {"rowwise": (1, None), "1x128": (1, 128), "128x128": (128, 128)}
# Several whole blocks and a partial one along each dimension.
SHAPES = {"varied": (300, 260), "special": (260, 300), "extremes": (200, 140), "all_tiny": (130, 129), "zeros": (5, 7)}


def assert_matches_oracle(q, x, block, fp8, **options):
    for direction in ("rowwise", "columnwise"):
        rows = int(np.prod(x.shape[:-1]))  # as_2d's reshape(-1, 0) cannot take an empty row
        expected = oracle.float8_block(oracle.as_f32(x).reshape(rows, x.shape[-1]), direction, *block, fp8=fp8, **options)
        storage = q.storage_for(direction)
        assert storage.data.dtype == FP8_DTYPES[fp8]
        oracle.assert_same_codes(storage.data, expected.codes, expected.code_mask, f"{direction} codes")
        oracle.assert_same_bits(storage.scale_inv, expected.scale_inv, f"{direction} scale_inv")
        oracle.assert_same_bits(q.dequantize(torch.float32, direction), expected.deq.reshape(x.shape), f"{direction} values")


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_block_scaling_matches_oracle_bitwise(inputs, dtype, fp8, block, kind):
    x = inputs.make(kind, SHAPES[kind], dtype)
    q = qtensor.Float8BlockQuantizer(FP8_DTYPES[fp8], *BLOCKS[block]).quantize(x)
    assert type(q) is qtensor.Float8BlockTensor
    assert_matches_oracle(q, x, BLOCKS[block], fp8)


@pytest.mark.parametrize("pow2_scales, amax_epsilon", [(True, 0.0), (False, 1.0), (True, 1e-30)])
@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("kind", ["special", "all_tiny"])
def test_block_scaling_options_match_oracle(inputs, kind, block, pow2_scales, amax_epsilon):
    x = inputs.make(kind, SHAPES[kind], torch.float32)
    quantizer = qtensor.Float8BlockQuantizer(block_rows=BLOCKS[block][0], block_cols=BLOCKS[block][1],
                                             pow2_scales=pow2_scales, amax_epsilon=amax_epsilon)
    assert_matches_oracle(quantizer.quantize(x), x, BLOCKS[block], "e4m3", pow2_scales=pow2_scales, amax_epsilon=amax_epsilon)


@pytest.mark.parametrize("shape", [(0, 256), (256, 0), (0, 0), (5, 0)])
@pytest.mark.parametrize("block", list(BLOCKS))
def test_empty_tensors_quantize_to_the_layouts_shapes(block, shape):
    """An empty batch (or an empty row) quantizes: as many scales as the layout declares, each 1
    for a block with nothing in it (docs/numerics.md: a zero amax gives scale 1)."""
    x = torch.randn(*shape)
    q = qtensor.Float8BlockQuantizer(block_rows=BLOCKS[block][0], block_cols=BLOCKS[block][1]).quantize(x)
    assert_matches_oracle(q, x, BLOCKS[block], "e4m3")
    if shape[1]:  # an empty batch through a layer
        layer = nn.Linear(shape[1], 8)
        qtensor.quantize_(layer, qtensor.recipes.float8_blockwise() if block != "rowwise" else qtensor.recipes.float8_rowwise())
        x = torch.randn(0, shape[1], requires_grad=True)
        layer(x).sum().backward()
        assert x.grad.shape == x.shape and torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))


def test_a_block_scale_is_set_by_its_own_block_alone():
    """One large value moves the scale of its 1x128 block and of no other (a per-tensor scale would
    move them all)."""
    x = torch.randn(4, 256)
    big = x.clone()
    big[1, 200] = 1e4
    before, after = (qtensor.Float8BlockQuantizer().quantize(t).rowwise.scale_inv for t in (x, big))
    changed = before != after
    assert changed[1, 1] and changed.sum() == 1


def test_square_blocks_hold_the_same_codes_in_both_copies_and_rebuild_one_from_the_other():
    x = torch.randn(300, 200)
    q = qtensor.Float8BlockQuantizer(block_rows=128, block_cols=128).quantize(x)
    assert torch.equal(q.columnwise.data.view(torch.uint8), q.rowwise.data.view(torch.uint8).t())
    assert torch.equal(q.columnwise.scale_inv, q.rowwise.scale_inv.t())
    only_rowwise = qtensor.Float8BlockQuantizer(block_rows=128, block_cols=128).quantize(x, columnwise=False)
    only_rowwise.update_usage(columnwise=True)
    assert torch.equal(only_rowwise.columnwise.data.view(torch.uint8), q.columnwise.data.view(torch.uint8))
    vector = qtensor.Float8BlockQuantizer(block_rows=1, block_cols=128).quantize(x, columnwise=False)
    with pytest.raises(ValueError, match="cannot rebuild its columnwise copy"):
        vector.update_usage(columnwise=True)


def test_row_slices_on_block_edges_hold_their_rows_and_column_splits_of_row_wise_scales_are_refused():
    x = torch.randn(256, 384)
    for block_rows, block_cols in BLOCKS.values():
        q = qtensor.Float8BlockQuantizer(block_rows=block_rows, block_cols=block_cols).quantize(x)
        top, bottom = q.split(128)
        assert torch.equal(torch.cat([top.dequantize(), bottom.dequantize()]), q.dequantize())
        # 1x128's columnwise copy and 128x128 tiles span 128 rows of x; row-wise scales one row each.
        spans_rows = q.rowwise if block_rows == 128 else q.columnwise
        if block_cols is None:
            assert torch.equal(q.split([64, 192])[1].dequantize(), q.dequantize()[64:])
        else:
            with pytest.raises(ValueError, match="breaks a block"):
                spans_rows.slice_rows(64, 256)
    row_wise = qtensor.Float8BlockQuantizer(block_rows=1, block_cols=None).quantize(x)
    with pytest.raises(ValueError, match="cannot be split along its columns"):
        row_wise.rowwise.slice_cols(0, 128)
    assert qtensor.Float8BlockQuantizer(block_rows=1, block_cols=None).shard_block() == (1, None)
    assert qtensor.Float8BlockQuantizer(block_rows=1, block_cols=128).shard_block() == (128, 128)


def test_bad_options_raise_naming_them():
    for options, message in [(dict(block_rows=64), "block_rows"), (dict(block_cols=64), "block_cols"),
                             (dict(block_rows=True), "block_rows"), (dict(block_rows=128, block_cols=None), "row-wise"),
                             (dict(pow2_scales=1), "pow2_scales"), (dict(amax_epsilon=-1.0), "amax_epsilon")]:
        with pytest.raises(ValueError, match=message):
            qtensor.Float8BlockQuantizer(**options)


def test_a_quantized_tensor_round_trips_through_safetensors_and_pickle(tmp_path):
    import io

    for block_rows, block_cols in BLOCKS.values():
        q = qtensor.Float8BlockQuantizer(torch.float8_e5m2, block_rows, block_cols, pow2_scales=True).quantize(torch.randn(130, 260))
        qtensor.save_file({"q": q}, tmp_path / "q.safetensors")
        restored = qtensor.load_file(tmp_path / "q.safetensors")["q"]
        buffer = io.BytesIO()
        torch.save(q, buffer)
        buffer.seek(0)
        for loaded in (restored, torch.load(buffer, weights_only=True)):
            assert type(loaded) is qtensor.Float8BlockTensor and loaded.quantizer == q.quantizer
            for direction in ("rowwise", "columnwise"):
                assert torch.equal(loaded.storage_for(direction).data.view(torch.uint8), q.storage_for(direction).data.view(torch.uint8))
                assert torch.equal(loaded.storage_for(direction).scale_inv, q.storage_for(direction).scale_inv)


# ---- the recipes ---------------------------------------------------------------------------------
def _layer_grads(recipe, x, g, weights="dynamic"):
    torch.manual_seed(0)
    layer = nn.Linear(x.shape[-1], g.shape[-1], bias=False)
    qtensor.quantize_(layer, recipe, weights=weights, strict=True)
    x = x.clone().requires_grad_()
    layer(x).backward(g)
    weight = layer.weight.plain() if isinstance(layer.weight, qtensor.DynamicWeight) else layer.weight.dequantize()
    return x.grad, layer.weight.grad, weight


def _quantized(quantizer, tensor, direction):
    return quantizer.quantize(tensor).dequantize(torch.float32, direction).double()


@pytest.mark.parametrize("recipe", ["float8_rowwise", "float8_rowwise_gw_hp", "float8_blockwise"])
def test_each_gemm_multiplies_the_operands_its_recipe_names(recipe):
    """dX = dY·W and dW = dYᵀ·X against fp64 products of the operands quantized as the recipe says:
    row-wise (or 1x128) copies of the gradient and the input along each GEMM's reduction dimension,
    the weight's copies, and for `gw_hp` the weight gradient from the high-precision dY and X."""
    torch.manual_seed(1)
    x, g = torch.randn(256, 384), torch.randn(256, 128)
    grad_x, grad_w, _ = _layer_grads(getattr(qtensor.recipes, recipe)(), x, g)
    torch.manual_seed(0)
    w = nn.Linear(384, 128, bias=False).weight.detach()
    vector = dict(block_rows=1, block_cols=None, pow2_scales=True) if recipe != "float8_blockwise" else dict(block_rows=1, block_cols=128)
    weight = vector if recipe != "float8_blockwise" else dict(block_rows=128, block_cols=128)
    activation, tile = qtensor.Float8BlockQuantizer(**vector), qtensor.Float8BlockQuantizer(**weight)
    expected_dx = _quantized(activation, g, "rowwise") @ _quantized(tile, w, "columnwise")
    if recipe == "float8_rowwise_gw_hp":
        expected_dw = g.double().t() @ x.double()
    else:
        expected_dw = _quantized(activation, g, "columnwise").t() @ _quantized(activation, x, "columnwise")
    torch.testing.assert_close(grad_x.double(), expected_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_w.double(), expected_dw, rtol=1e-5, atol=1e-4)


def test_gw_hp_takes_the_weight_gradient_from_the_autocast_dtypes_values():
    """Under bf16 autocast, as an unquantized nn.Linear: dW = dYᵀ·X from bf16 X and bf16 dY (the
    layer's input is fp32, as a norm's output under autocast), a bf16 GEMM on a GPU, not an fp32 one."""
    torch.manual_seed(2)
    layer = nn.Linear(384, 128, bias=False)
    plain = nn.Linear(384, 128, bias=False)
    plain.load_state_dict(layer.state_dict())
    qtensor.quantize_(layer, qtensor.recipes.float8_rowwise_gw_hp(), strict=True)
    x, g = torch.randn(256, 384), torch.randn(256, 128)
    for module in (layer, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x)
        assert y.dtype == torch.bfloat16
        y.backward(g.to(torch.bfloat16))
    expected = g.to(torch.bfloat16).double().t() @ x.to(torch.bfloat16).double()
    torch.testing.assert_close(layer.weight.grad.double(), expected, rtol=1e-5, atol=1e-4)
    # The unquantized layer's weight gradient, its bf16 GEMM's rounding aside.
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad, rtol=2**-7, atol=1e-2)
    saved = qtensor.recipes.float8_rowwise_gw_hp()(qtensor.Role("linear", "input", "layer"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        columnwise = saved.quantize(x).columnwise
    assert columnwise.data.dtype == torch.bfloat16


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe", ["float8_rowwise", "float8_rowwise_gw_hp", "float8_blockwise"])
def test_the_recipes_train_a_stock_model(recipe, weights):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 128))
    report = qtensor.quantize_(model, getattr(qtensor.recipes, recipe)(), weights=weights, strict=True)
    assert len(report.quantized) == 2
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if weights == "quantized":
        optimizer = qtensor.optim.MasterWeights(optimizer)
    x, target = torch.randn(128, 256), torch.randn(128, 128)
    losses = []
    for _ in range(20):  # quantized weights move by whole FP8 steps: the first few steps are noise
        loss = (model(x) - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(isinstance(layer.weight, (qtensor.DynamicWeight, qtensor.Float8BlockTensor)) for layer in (model[0], model[2]))


def test_the_hybrids_take_block_scaled_copies():
    """Block-wise forward, NVFP4 backward, through the existing HybridQuantizer."""
    quantizer = qtensor.HybridQuantizer(qtensor.Float8BlockQuantizer(block_rows=1, block_cols=128), qtensor.NVFP4Quantizer())
    x = torch.randn(256, 256)
    q = quantizer.quantize(x)
    assert q.rowwise.format_name == "float8_block" and q.columnwise.format_name == "nvfp4"
    expected = oracle.float8_block(x.numpy(), "rowwise", 1, 128)
    oracle.assert_same_bits(q.dequantize(torch.float32, "rowwise"), expected.deq)
    layer = nn.Linear(256, 64)
    qtensor.quantize_(layer, lambda role: quantizer.copy() if role.tensor_type != "grad_output" else qtensor.NVFP4Quantizer(), strict=True)
    layer(torch.randn(16, 256)).square().mean().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


# ---- through FSDP2 and tensor parallelism (block_cases.py, 2 gloo ranks) -----------------------------
RUN = workers.Background("distributed", workers.rank_commands("block_cases.py", world=2), timeout=300)


@pytest.fixture(scope="module")
def distributed():
    return torch.load(RUN.results() / "results.pt", weights_only=False)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe", ["float8_blockwise", "float8_rowwise"])
def test_fsdp2_trains_block_scaled_weights_like_one_process(distributed, recipe, weights):
    """Shards on the 128-row tiles (block-wise), or each column's scale reduced over the ranks
    (row-wise weights' columnwise copies): the shards hold exactly the one-process tensor's bytes."""
    import block_cases

    parallel = distributed[("fsdp2", recipe, weights)]
    single = block_cases.train(block_cases.build(recipe, weights), weights)
    torch.testing.assert_close(torch.tensor(parallel["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    for name, weight in single["weights"].items():
        torch.testing.assert_close(parallel["weights"][name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_tensor_parallelism_splits_block_wise_layers_and_refuses_column_splits_of_row_wise_ones(distributed):
    import block_cases

    single = block_cases.train(block_cases.build("float8_blockwise", "dynamic"), "dynamic")
    parallel = distributed[("tp", "float8_blockwise")]
    torch.testing.assert_close(torch.tensor(parallel["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    refused = distributed[("tp", "float8_rowwise")]
    # The column-parallel layer's output gradient is split along its columns (row-wise scales span them).
    assert "layer '0'" in refused and "output gradient" in refused and "whole rows" in refused, refused


def test_an_fsdp2_shard_that_cuts_a_128_row_tile_raises_naming_the_parameter(distributed):
    message = distributed["cut"]
    assert "2.weight" in message and "128" in message, message
