"""Dispatch behaviour of every quantized tensor type (docs/design.md, Dispatch).

Values are checked against the dequantized whole (the op must not change what is stored) or
against a fresh quantization of the same input (what `copy_` and `zero_` promise).
"""

import copy
import io
import math

import pytest
import torch

import qtensor
from cases import FORMATS

TENSOR_CLASS = {
    "float8": qtensor.Float8Tensor,
    "float8_delayed": qtensor.Float8Tensor,
    "mxfp8": qtensor.MXFP8Tensor,
    "nvfp4": qtensor.NVFP4Tensor,
    "nvfp4_rht": qtensor.NVFP4Tensor,
    "nvfp4_2d": qtensor.NVFP4Tensor,
    "identity": qtensor.IdentityTensor,
    "hybrid": qtensor.HybridQuantizedTensor,
}


def sample(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * 4).to(dtype)


def assert_same_values(actual, expected):
    assert torch.equal(actual.float().nan_to_num(7.0), expected.float().nan_to_num(7.0))


def assert_same_bytes(a: qtensor.QuantizedTensor, b: qtensor.QuantizedTensor):
    for direction in ("rowwise", "columnwise"):
        mine, theirs = getattr(a, direction), getattr(b, direction)
        assert (mine is None) == (theirs is None)
        if mine is not None:
            for name, buffer in mine.buffers.items():
                assert torch.equal(buffer.reshape(-1).view(torch.uint8), theirs.buffers[name].reshape(-1).view(torch.uint8)), (direction, name)


@pytest.fixture(params=list(FORMATS))
def fmt(request):
    return request.param


@pytest.fixture
def q(fmt):
    return FORMATS[fmt]().quantize(sample(4, 16, 48, dtype=torch.bfloat16))


def both_directions(q):
    return [d for d in ("rowwise", "columnwise") if getattr(q, d) is not None]


def test_quantized_tensor_reports_logical_shape_dtype_and_class(fmt, q):
    assert type(q) is TENSOR_CLASS[fmt]
    assert isinstance(q, qtensor.QuantizedTensor)
    assert q.shape == (4, 16, 48) and q.dtype == torch.bfloat16 and q.device.type == "cpu"
    assert q.has_rowwise and q.has_columnwise
    assert q.dequantize().dtype == torch.bfloat16 and q.dequantize(torch.float32).shape == (4, 16, 48)


def test_detach_and_alias_share_storage_but_are_new_wrappers(q):
    for result in (q.detach(), torch.ops.aten.alias(q)):
        assert type(result) is type(q) and result is not q
        assert result.rowwise is q.rowwise and result.columnwise is q.columnwise
        assert_same_values(result.dequantize(), q.dequantize())


def test_clone_copies_every_buffer(q):
    result = q.clone()
    assert type(result) is type(q)
    assert_same_bytes(result, q)
    for direction in both_directions(q):
        for name, buffer in getattr(result, direction).buffers.items():
            assert buffer.data_ptr() != getattr(q, direction).buffers[name].data_ptr()


def test_to_dtype_keeps_quantized_storage_and_changes_logical_dtype(q):
    result = q.to(torch.float32)
    assert type(result) is type(q) and result.dtype == torch.float32
    assert_same_bytes(result, q)
    assert_same_values(result.dequantize(), q.dequantize(torch.float32))


def test_to_integer_dtype_gives_plain_tensor(q):
    result = q.to(torch.int32)
    assert type(result) is torch.Tensor and result.dtype == torch.int32


def test_view_keeping_last_dim_stays_quantized_and_never_returns_self(q):
    expected = q.dequantize()
    for shape in ((64, 48), (-1, 48), (2, 32, 48)):
        result = q.view(*shape)
        assert type(result) is type(q) and result is not q
        assert_same_values(result.dequantize(), expected.reshape(result.shape))
    assert type(q.reshape(64, 48)) is type(q)


def test_view_changing_last_dim_gives_the_dequantized_values(q):
    result = q.view(4, 16 * 48)  # computed when used, never stored (ops.DequantizedView)
    assert not isinstance(result, qtensor.QuantizedTensor) and result.shape == (4, 16 * 48)
    assert_same_values(result, q.dequantize().view(4, 16 * 48))
    assert type(result + 0) is torch.Tensor
    before = q.dequantize()
    result.add_(1)  # a write into such a view does not reach q (README "Known limits")
    assert_same_values(q.dequantize(), before)


def test_identity_as_strided_is_an_alias(q):
    result = torch.as_strided(q, q.shape, q.stride())
    assert type(result) is type(q) and result is not q


@pytest.mark.parametrize("how", ["split", "chunk", "slice", "split_with_sizes"])
def test_dim0_split_on_block_boundaries_keeps_values(q, how):
    expected = {d: q.dequantize(torch.float32, d) for d in both_directions(q)}
    if how == "split":
        pieces = q.split(2, dim=0)
    elif how == "chunk":
        pieces = q.chunk(2)
    elif how == "slice":
        pieces = [q[0:2], q[2:4]]
    else:
        pieces = q.split([2, 2])
    assert len(pieces) == 2
    for index, piece in enumerate(pieces):
        assert type(piece) is type(q) and piece.shape == (2, 16, 48)
        for direction, whole in expected.items():
            assert_same_values(piece.dequantize(torch.float32, direction), whole[2 * index : 2 * index + 2])


@pytest.mark.parametrize("fmt_name,block", [("mxfp8", 32), ("nvfp4", 16), ("hybrid", 16)])
def test_dim0_split_breaking_a_columnwise_block_raises(fmt_name, block):
    q = FORMATS[fmt_name]().quantize(sample(64, 48))
    with pytest.raises(ValueError, match=f"multiples of {block}"):
        q.split(20)
    with pytest.raises(ValueError, match="breaks a block"):
        q[5:40]


@pytest.mark.parametrize("fmt_name", ["mxfp8", "nvfp4", "hybrid"])
def test_a_slice_ending_inside_a_block_keeps_exact_values_but_cannot_be_requantized(fmt_name):
    q = FORMATS[fmt_name]().quantize(sample(64, 48))
    head = q[:40]  # starts on a block boundary, ends inside the second 32-row block
    for direction in ("rowwise", "columnwise"):
        assert_same_values(head.dequantize(torch.float32, direction), q.dequantize(torch.float32, direction)[:40])
    with pytest.raises(ValueError, match="share a|covers the whole tensor"):
        head.copy_(sample(40, 48, seed=3))
    head.clone().copy_(sample(40, 48, seed=3))  # a copy owns its blocks


def test_dim0_split_of_rowwise_only_block_format_is_free():
    q = qtensor.MXFP8Quantizer().quantize(sample(64, 48), columnwise=False)
    pieces = q.split(20)
    assert [p.shape[0] for p in pieces] == [20, 20, 20, 4]
    assert_same_values(torch.cat([p.dequantize() for p in pieces]), q.dequantize())


def test_ragged_last_piece_keeps_partial_block():
    x = sample(70, 40)
    q = qtensor.MXFP8Quantizer().quantize(x)
    head, tail = q.split(64)
    assert tail.shape == (6, 40)
    assert_same_values(tail.dequantize(torch.float32, "columnwise"), q.dequantize(torch.float32, "columnwise")[64:])


# Columns one block spans along a row (docs/numerics.md): MXFP8's 1x32 blocks (a hybrid's rowwise
# copy), NVFP4's 1x16 (and 16x16 tiles).
COLUMN_BLOCK = {"float8": 1, "float8_delayed": 1, "mxfp8": 32, "nvfp4": 16, "nvfp4_rht": 16, "nvfp4_2d": 16, "identity": 1, "hybrid": 32}


@pytest.mark.parametrize("width", [16, 32])
def test_split_along_the_last_dim_keeps_the_format_on_block_edges_and_refuses_to_cut_a_block(fmt, q, width):
    """A row-parallel weight's shard: columns [a, b) of every direction, sharing the stored bytes."""
    if width % COLUMN_BLOCK[fmt]:
        with pytest.raises(ValueError, match=f"blocks span {COLUMN_BLOCK[fmt]} columns"):
            q.split(width, dim=-1)
        return
    pieces = q.split(width, dim=-1)
    assert [p.shape for p in pieces] == [(4, 16, min(width, 48 - start)) for start in range(0, 48, width)]
    for index, piece in enumerate(pieces):
        assert type(piece) is type(q)
        for direction in both_directions(q):
            expected = q.dequantize(torch.float32, direction)[..., index * width : (index + 1) * width]
            assert_same_values(piece.dequantize(torch.float32, direction), expected)
    length = min(width, 48 - width)
    assert_same_values(q.narrow(-1, width, length).dequantize(), q.dequantize()[..., width : width + length])


def test_split_along_a_middle_dim_falls_back_to_plain(q):
    pieces = q.split(8, dim=1)
    assert all(type(p) is torch.Tensor for p in pieces)
    assert_same_values(torch.cat(pieces, 1), q.dequantize())


def test_copy_from_plain_requantizes_with_own_quantizer_and_usages(fmt):
    quantizer = FORMATS[fmt]()
    target = quantizer.quantize(sample(64, 48, seed=1), columnwise=fmt != "hybrid")
    source = sample(64, 48, seed=2)
    expected = FORMATS[fmt]().quantize(source, columnwise=fmt != "hybrid")
    if fmt == "float8_delayed":  # the same amax history as `quantizer` had before the copy
        expected = quantizer.copy().quantize(source, columnwise=True)
    result = target.copy_(source)
    assert result is target
    assert_same_bytes(target, expected)


def test_copy_from_same_format_is_byte_for_byte(fmt):
    target = FORMATS[fmt]().quantize(sample(64, 48, seed=1))
    source = FORMATS[fmt]().quantize(sample(64, 48, seed=2) * 100)
    target.copy_(source)
    assert_same_bytes(target, source)


def test_copy_from_other_format_requantizes_its_dequantized_value():
    target = qtensor.MXFP8Quantizer().quantize(sample(64, 48, seed=1))
    source = qtensor.NVFP4Quantizer().quantize(sample(64, 48, seed=2))
    target.copy_(source)
    assert_same_bytes(target, qtensor.MXFP8Quantizer().quantize(source.dequantize()))


def test_copy_into_a_split_piece_writes_through_to_the_whole():
    whole = qtensor.MXFP8Quantizer().quantize(sample(64, 48, seed=1))
    top, bottom = whole.split(32)
    new_rows = sample(32, 48, seed=3)
    bottom.copy_(new_rows)
    expected = qtensor.MXFP8Quantizer().quantize(new_rows).dequantize()
    assert_same_values(whole.dequantize()[32:], expected)
    assert_same_values(whole.dequantize(direction="columnwise")[32:], expected)


@pytest.mark.parametrize("make", ["new_zeros", "new_empty", "empty_like", "zeros_like"])
def test_new_tensors_are_quantized_zeros_of_the_same_format(q, make):
    if make in ("new_zeros", "new_empty"):
        result = getattr(q, make)((32, 48))
        shape = (32, 48)
    else:
        result = getattr(torch, make)(q)
        shape = q.shape
    assert type(result) is type(q) and result.shape == shape
    assert result.has_rowwise == q.has_rowwise and result.has_columnwise == q.has_columnwise
    for direction in both_directions(q):
        assert torch.count_nonzero(result.dequantize(direction=direction)) == 0


def test_zero_makes_every_direction_zero_in_place(q):
    result = q.zero_()
    assert result is q
    for direction in both_directions(q):
        assert torch.count_nonzero(q.dequantize(direction=direction)) == 0


def test_new_zeros_leaves_delayed_scaling_history_untouched():
    quantizer = qtensor.Float8Quantizer(scaling="delayed")
    q = quantizer.quantize(sample(32, 32))
    history = quantizer.amax_history.clone()
    q.new_zeros((16, 32))
    q.zero_()
    assert torch.equal(quantizer.amax_history, history)


def test_is_pinned_reports_buffer_pinning(q):
    assert q.is_pinned() is False


def test_unsupported_ops_compute_on_dequantized_values_and_return_plain_tensors(q):
    expected = q.dequantize()
    for result, reference in (
        (q + 1, expected + 1),
        (q.sum(), expected.sum()),
        (q * q, expected * expected),
        (torch.nn.functional.relu(q), torch.relu(expected)),
        (q.t() if q.dim() == 2 else q.transpose(0, 1), expected.transpose(0, 1)),
    ):
        assert type(result) is torch.Tensor
        assert_same_values(result, reference)
    assert torch.allclose(q, expected)


def test_in_place_arithmetic_requantizes_into_the_tensor(fmt):
    quantizer = FORMATS[fmt]()
    x = sample(64, 48)
    q = quantizer.quantize(x)
    before = q.dequantize()
    reference_quantizer = quantizer.copy()
    result = q.mul_(3.0)
    assert result is q and type(q) is TENSOR_CLASS[fmt]
    assert_same_bytes(q, reference_quantizer.quantize(before * 3.0))


def test_update_usage_drops_a_direction(q):
    q.update_usage(columnwise=False)
    assert q.has_rowwise and not q.has_columnwise
    with pytest.raises(ValueError, match="holds no columnwise data"):
        q.dequantize(direction="columnwise")
    with pytest.raises(ValueError, match="keeps at least one"):
        q.update_usage(rowwise=False)


def test_update_usage_rebuilds_float8_and_identity_directions():
    for quantizer in (qtensor.Float8Quantizer(), qtensor.IdentityQuantizer()):
        x = sample(40, 24)
        q = quantizer.quantize(x, columnwise=False)
        q.update_usage(columnwise=True)
        assert q.has_columnwise
        assert_same_values(q.dequantize(direction="columnwise"), q.dequantize(direction="rowwise"))


@pytest.mark.parametrize("fmt_name", ["mxfp8", "nvfp4", "hybrid"])
def test_update_usage_cannot_rebuild_a_block_direction(fmt_name):
    q = FORMATS[fmt_name]().quantize(sample(64, 48), columnwise=False)
    with pytest.raises(ValueError, match="Quantize the high-precision tensor again"):
        q.update_usage(columnwise=True)


def test_storage_nbytes_counts_real_low_precision_buffers():
    m, k = 70, 45
    x = sample(m, k)
    ceil = lambda a, b: -(-a // b)  # noqa: E731
    expected = {
        "float8": 2 * m * k + 4,  # data and its transpose, one shared fp32 scale
        "mxfp8": 2 * m * k + m * ceil(k, 32) + ceil(m, 32) * k,
        "nvfp4": m * ceil(k, 2) + m * ceil(k, 16) + k * ceil(m, 2) + k * ceil(m, 16) + 4,  # one shared amax
        "identity": m * k * 4,
    }
    for name, nbytes in expected.items():
        assert FORMATS[name]().quantize(x).storage_nbytes() == nbytes, name
    assert FORMATS["mxfp8"]().quantize(x, columnwise=False).storage_nbytes() == m * k + m * ceil(k, 32)


def test_pickle_round_trips_byte_for_byte_with_weights_only(q):
    buffer = io.BytesIO()
    torch.save({"q": q}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["q"]
    assert type(loaded) is type(q) and loaded.shape == q.shape and loaded.dtype == q.dtype
    assert repr(loaded.quantizer) == repr(q.quantizer)
    assert_same_bytes(loaded, q)


def test_pickle_keeps_delayed_scaling_history():
    quantizer = qtensor.Float8Quantizer(scaling="delayed")
    for scale in (1.0, 5.0):
        q = quantizer.quantize(sample(8, 8) * scale)
    buffer = io.BytesIO()
    torch.save(q, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert torch.equal(loaded.quantizer.amax_history, quantizer.amax_history)


def test_deepcopy_is_independent(q):
    duplicate = copy.deepcopy(q)
    assert type(duplicate) is type(q)
    assert_same_bytes(duplicate, q)
    duplicate.zero_()
    assert torch.count_nonzero(q.dequantize()) > 0


def test_quantizer_copy_is_independent_with_same_config():
    quantizer = qtensor.Float8Quantizer(scaling="delayed", margin=1)
    quantizer.quantize(sample(8, 8))
    duplicate = quantizer.copy()
    assert repr(duplicate) == repr(quantizer)
    duplicate.quantize(sample(8, 8) * 100)
    recorded = lambda q: int((q.amax_history >= 0).sum())  # noqa: E731  (unfilled entries are -1)
    assert recorded(quantizer) == 1 and recorded(duplicate) == 2
    assert duplicate == quantizer and duplicate is not quantizer  # configuration compares by value


def test_repr_shows_the_whole_configuration():
    text = repr(qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(scale_rounding="floor"), qtensor.NVFP4Quantizer(rht=True)))
    assert "scale_rounding='floor'" in text and "rht=True" in text and "columnwise_source='original'" in text
    assert "MXFP8Tensor(shape=[4, 8]" in repr(qtensor.MXFP8Quantizer().quantize(sample(4, 8)))


def test_zero_row_tensors_quantize(fmt):
    q = FORMATS[fmt]().quantize(torch.zeros(0, 48))
    assert q.shape == (0, 48)
    for direction in both_directions(q):
        assert q.dequantize(direction=direction).shape == (0, 48)


def test_one_dimensional_input_is_one_row(fmt):
    x = sample(48)
    q = FORMATS[fmt]().quantize(x)
    assert q.shape == (48,)
    assert_same_values(q.dequantize(), FORMATS[fmt]().quantize(x.reshape(1, 48)).dequantize().reshape(48))


@pytest.mark.parametrize("bad", [torch.arange(6).reshape(2, 3), torch.zeros(2, 3, dtype=torch.complex64), torch.zeros(2, 3, dtype=torch.float64)])
def test_non_float_input_is_a_type_error(fmt, bad):
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        FORMATS[fmt]().quantize(bad)


def test_asking_no_direction_is_a_value_error(fmt):
    with pytest.raises(ValueError, match="no direction"):
        FORMATS[fmt]().quantize(sample(4, 4), rowwise=False, columnwise=False)


def test_scalar_input_is_a_value_error():
    with pytest.raises(ValueError, match="at least one dimension"):
        qtensor.MXFP8Quantizer().quantize(torch.tensor(1.0))


@pytest.mark.parametrize(
    "make",
    [
        lambda: qtensor.Float8Quantizer(scaling="sometimes"),
        lambda: qtensor.Float8Quantizer(fp8_dtype=torch.float16),
        lambda: qtensor.Float8Quantizer(amax_compute_algo="mean"),
        lambda: qtensor.Float8Quantizer(margin=-3.5),
        lambda: qtensor.Float8Quantizer(scaling="delayed", margin=128),
        lambda: qtensor.Float8Quantizer(amax_epsilon="x"),
        lambda: qtensor.MXFP8Quantizer(scale_rounding="nearest"),
        lambda: qtensor.NVFP4Quantizer(block_2d=True, rht=True),
        lambda: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer(), columnwise_source="x"),
        lambda: qtensor.IdentityQuantizer(dtype=torch.int8),
    ],
)
def test_unknown_options_are_value_errors(make):
    with pytest.raises(ValueError, match="must|cannot be combined"):
        make()


def test_hybrid_rejects_one_instance_for_both_directions():
    shared = qtensor.MXFP8Quantizer()
    with pytest.raises(ValueError, match="same quantizer instance"):
        qtensor.HybridQuantizer(shared, shared)


def test_requesting_a_missing_direction_names_the_fix():
    q = qtensor.NVFP4Quantizer().quantize(sample(16, 16), rowwise=False)
    with pytest.raises(ValueError, match="rowwise=True"):
        q.dequantize(direction="rowwise")
    assert q.dequantize().shape == (16, 16)  # None: the direction it has
    with pytest.raises(ValueError, match="'rowwise', 'columnwise' or None"):
        q.dequantize(direction="diagonal")


def test_nn_module_can_hold_a_quantized_parameter():
    layer = torch.nn.Linear(48, 64, bias=False)
    layer.weight = torch.nn.Parameter(qtensor.MXFP8Quantizer().quantize(layer.weight.detach()), requires_grad=False)
    assert isinstance(layer.weight, qtensor.MXFP8Tensor)
    state = layer.state_dict()
    assert isinstance(state["weight"], qtensor.MXFP8Tensor)
    assert math.isclose(layer.weight.dequantize().abs().sum().item(), state["weight"].dequantize().abs().sum().item())


@pytest.mark.parametrize("fmt_name", ["float8", "nvfp4"])
def test_quantizing_into_a_slice_of_a_per_tensor_scaled_tensor_is_refused(fmt_name):
    whole = FORMATS[fmt_name]().quantize(sample(64, 48))
    before = whole.dequantize()
    with pytest.raises(ValueError, match="row slice"):
        whole[32:].copy_(sample(32, 48, seed=5))
    assert_same_values(whole.dequantize(), before)
    piece = whole[32:].clone()
    piece.copy_(sample(32, 48, seed=5))
    assert_same_values(whole.dequantize(), before)


def test_user_subclasses_do_not_shadow_the_formats_a_file_names():
    class MyMXFP8(qtensor.MXFP8Quantizer):
        pass

    class MyTensor(qtensor.MXFP8Tensor):
        pass

    q = qtensor.MXFP8Quantizer().quantize(sample(8, 32))
    buffer = io.BytesIO()
    torch.save(q, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded) is qtensor.MXFP8Tensor and type(loaded.quantizer) is qtensor.MXFP8Quantizer


@pytest.mark.parametrize("fmt_name", ["float8", "mxfp8"])
def test_nan_elements_are_stored_as_one_canonical_code(fmt_name):
    x = torch.ones(4, 32)
    x[0, 0] = float("nan")
    x[1, 1] = -float("nan")
    x = x.to(torch.bfloat16)
    q = FORMATS[fmt_name]().quantize(x, columnwise=False)
    codes = q.rowwise.data.view(torch.uint8)
    assert codes[0, 0] == 0x7F and codes[1, 1] == 0x7F


def test_same_format_bytes_with_another_scale_are_refused_in_a_row_slice():
    whole = qtensor.Float8Quantizer().quantize(sample(64, 48))
    before = whole.dequantize()
    top, _ = whole.split(32)
    with pytest.raises(ValueError, match="row slice"):
        top.copy_(qtensor.Float8Quantizer().quantize(sample(32, 48) * 100))
    assert_same_values(whole.dequantize(), before)
    top.copy_(top.clone())  # same scale: allowed
    assert_same_values(whole.dequantize(), before)


def test_item_assignment_requantizes_the_whole_tensor(fmt):
    quantizer = FORMATS[fmt]()
    q = quantizer.quantize(sample(64, 48))
    expected_values = q.dequantize()
    expected_values[3] = 0.5
    expected_values[:, :8] = 2.0
    reference = quantizer.copy()
    q[3] = 0.5
    q[:, :8] = 2.0
    assert type(q) is TENSOR_CLASS[fmt]
    expected = reference.quantize(expected_values)
    if fmt != "float8_delayed":  # the first assignment moved the history on
        assert_same_values(q.dequantize(), expected.dequantize())


def test_unsqueeze_and_squeeze_keeping_the_last_dim_stay_quantized(q):
    assert type(q.unsqueeze(0)) is type(q) and q.unsqueeze(0).shape == (1, 4, 16, 48)
    assert type(q.unsqueeze(0).squeeze(0)) is type(q)
    assert type(q.unsqueeze(-1)) is torch.Tensor


def test_new_tensors_of_a_non_float_dtype_are_plain(q):
    for result in (q.new_zeros((2, 3), dtype=torch.int64), torch.zeros_like(q, dtype=torch.bool)):
        assert type(result) is torch.Tensor and not result.dtype.is_floating_point


def test_plain_tensor_copy_from_quantized_takes_the_dequantized_value(q):
    plain = torch.zeros(q.shape, dtype=torch.float32)
    plain.copy_(q)
    assert_same_values(plain, q.dequantize().float())  # the logical (bf16) value


def test_fp16_dequantize_saturates_instead_of_overflowing():
    x = torch.full((4, 32), 64000.0, dtype=torch.float16)  # MXFP8 represents it as 2**16
    q = qtensor.MXFP8Quantizer().quantize(x)
    assert q.dequantize(torch.float32)[0, 0] == 65536.0
    assert torch.all(q.dequantize() == torch.finfo(torch.float16).max)
    hybrid = qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer(), columnwise_source="rowwise_dequantized")
    assert torch.isfinite(hybrid.quantize(x).dequantize(direction="columnwise")).all()
    inf = torch.full((2, 4), float("inf"), dtype=torch.float16)
    assert torch.isinf(qtensor.Float8Quantizer(torch.float8_e5m2).quantize(inf).dequantize()).all()


def test_pickling_a_split_piece_saves_only_its_own_bytes():
    whole = qtensor.MXFP8Quantizer().quantize(sample(1024, 64))
    piece = whole.split(32)[0]
    buffer = io.BytesIO()
    torch.save(piece, buffer)
    assert len(buffer.getvalue()) < 4 * piece.storage_nbytes()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert_same_bytes(loaded, piece)


def test_quantized_zeros_leave_the_stochastic_rounding_generator_alone():
    def draws(make_zeros):
        quantizer = qtensor.NVFP4Quantizer(stochastic_rounding=True, seed=3)
        q = quantizer.quantize(sample(32, 32, seed=1))
        if make_zeros:
            q.new_zeros((32, 32))
            q.zero_()
        return quantizer.quantize(sample(32, 32, seed=2))

    assert_same_bytes(draws(False), draws(True))


def test_fallbacks_can_be_made_to_raise_or_be_counted():
    q = FORMATS["mxfp8"]().quantize(sample(4, 32))
    assert torch.equal(q + 1, q.dequantize() + 1)  # allowed by default
    with qtensor.fallbacks("raise"):
        with pytest.raises(RuntimeError, match=r"aten\.add\.Tensor.*MXFP8Tensor.*dequantized"):
            q + 1
        q.detach(), q.clone(), q[:2]  # ops with a quantized implementation run as usual
    qtensor.fallback_report(reset=True)
    with qtensor.fallbacks("count"):
        q.sum(), q.sum(), q * 2
    report = qtensor.fallback_report(reset=True)
    assert report[("aten.sum.default", "MXFP8Tensor")] == 2 and report[("aten.mul.Tensor", "MXFP8Tensor")] == 1
    with pytest.raises(ValueError, match="mode must be"):
        with qtensor.fallbacks("warn"):
            pass


def test_the_fallback_switch_is_also_an_environment_variable():
    import os
    import subprocess
    import sys

    code = "import torch, qtensor\nq = qtensor.Float8Quantizer().quantize(torch.ones(4, 4))\nq.sum()\n"
    env = dict(os.environ, QTENSOR_FALLBACKS="raise")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "has no quantized implementation" in done.stderr
