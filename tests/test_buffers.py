"""The buffer contract (storage.py): what each format declares, and what is derived from it.

Buffer shapes are checked against numbers written here from docs/numerics.md, Buffer layouts, concatenated row pieces
against the tensor they were cut from, and the flatten context against torch.compile's needs
(hashable, compared by value, no shape, no tensors).
"""

import copy
import math

import pytest
import torch
from torch import nn

import qtensor
from cases import FORMATS
from qtensor.core.storage import Storage



def ceil(a, b):
    return -(-a // b)


def sample(*shape, dtype=torch.bfloat16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * 2).to(dtype)


def same_bytes(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def all_buffers_equal(a, b):
    mine, _ = a.to_buffers()
    theirs, _ = b.to_buffers()
    return mine.keys() == theirs.keys() and all(same_bytes(mine[n], theirs[n]) for n in mine)


@pytest.mark.parametrize("rows, cols", [(64, 96), (37, 45), (5, 7)])
def test_declared_layouts_are_the_spec_shapes(rows, cols):
    e4m3 = torch.float8_e4m3fn
    x = sample(rows, cols)
    expected = {
        "float8": {"rowwise.data": (e4m3, (rows, cols)), "columnwise.data": (e4m3, (cols, rows)), "scale_inv": (torch.float32, ())},
        "mxfp8": {
            "rowwise.data": (e4m3, (rows, cols)),
            "rowwise.scale_inv": (torch.uint8, (rows, ceil(cols, 32))),
            "columnwise.data": (e4m3, (rows, cols)),
            "columnwise.scale_inv": (torch.uint8, (ceil(rows, 32), cols)),
        },
        "nvfp4": {
            "rowwise.data": (torch.uint8, (rows, ceil(cols, 2))),
            "rowwise.scale_inv": (e4m3, (rows, ceil(cols, 16))),
            "columnwise.data": (torch.uint8, (cols, ceil(rows, 2))),
            "columnwise.scale_inv": (e4m3, (cols, ceil(rows, 16))),
            "global_amax": (torch.float32, ()),
        },
        "nvfp4_rht": {
            "rowwise.data": (torch.uint8, (rows, ceil(cols, 2))),
            "rowwise.scale_inv": (e4m3, (rows, ceil(cols, 16))),
            "rowwise.global_amax": (torch.float32, ()),
            "columnwise.data": (torch.uint8, (cols, 8 * ceil(rows, 16))),  # rows padded to whole runs of 16
            "columnwise.scale_inv": (e4m3, (cols, ceil(rows, 16))),
            "columnwise.global_amax": (torch.float32, ()),
        },
        "identity": {"rowwise.data": (torch.bfloat16, (rows, cols))},
    }
    for name, buffers in expected.items():
        actual, _ = FORMATS[name]().quantize(x).to_buffers()
        assert {n: (b.dtype, tuple(b.shape)) for n, b in actual.items()} == buffers, name


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_row_pieces_concatenate_back_to_the_tensor_they_were_cut_from(fmt):
    whole = FORMATS[fmt]().quantize(sample(4, 32, 40))  # 128 rows: blocks of 32 and 16 both fit
    pieces = whole.split([1, 2, 1])
    for direction in ("rowwise", "columnwise"):
        storages = [getattr(piece, direction) for piece in pieces]
        joined = type(storages[0]).cat_rows(storages)
        original = getattr(whole, direction)
        assert (joined.rows, joined.cols) == (original.rows, original.cols)
        for name, buffer in original.buffers.items():
            assert same_bytes(joined.buffers[name], buffer), (direction, name)


def test_concatenating_pieces_that_break_a_block_or_carry_other_scales_is_refused():
    whole = qtensor.MXFP8Quantizer().quantize(sample(64, 32))
    first, second = whole.columnwise.slice_rows(0, 32), whole.columnwise.slice_rows(32, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        Storage.cat_rows([qtensor.MXFP8Quantizer().quantize(sample(20, 32)).columnwise, second])
    assert Storage.cat_rows([first, second]).rows == 64
    a, b = qtensor.Float8Quantizer().quantize(sample(8, 8)), qtensor.Float8Quantizer().quantize(sample(8, 8, seed=1) * 9)
    with pytest.raises(ValueError, match="different scale_inv"):
        Storage.cat_rows([a.rowwise, b.rowwise])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_whole_tensor_inside_a_larger_flat_buffer_is_not_a_slice(fmt):
    """What an all-gather produces: every buffer a view into one flat byte buffer."""
    source = FORMATS[fmt]().quantize(sample(64, 48))
    buffers, metadata = source.to_buffers(quantizer_state=False)
    flat = torch.zeros(sum(b.nbytes for b in buffers.values()) + 64, dtype=torch.uint8)
    views, offset = {}, 16
    for name, buffer in buffers.items():
        raw = flat[offset : offset + buffer.nbytes]
        raw.copy_(buffer.reshape(-1).contiguous().view(torch.uint8))
        views[name] = raw.view(buffer.dtype).reshape(buffer.shape)
        offset += buffer.nbytes
    gathered = qtensor.QuantizedTensor.from_buffers(views, metadata, quantizer=source.quantizer)
    assert all_buffers_equal(gathered, source)
    new_values = sample(64, 48, seed=7)
    reference = source.quantizer.copy()  # same configuration and running state, before the copy moves it
    gathered.copy_(new_values)  # accepted: a whole tensor, whatever memory its buffers live in
    assert all_buffers_equal(gathered, reference.quantize(new_values))


def test_slicing_sets_the_slice_flag_and_copies_clear_it():
    whole = qtensor.Float8Quantizer().quantize(sample(64, 16))
    top, _ = whole.split(32)
    assert top.rowwise.row_slice and not whole.rowwise.row_slice
    assert top.detach().rowwise.row_slice  # an alias is still the slice
    assert not top.clone().rowwise.row_slice
    assert not whole[0:64].rowwise.row_slice  # the whole range is no slice
    with pytest.raises(ValueError, match="row slice"):
        top.copy_(sample(32, 16))
    top.clone().copy_(sample(32, 16))


def test_incoming_buffers_are_checked_against_the_declared_layout():
    q = qtensor.MXFP8Quantizer().quantize(sample(40, 64))
    buffers, metadata = q.to_buffers()
    wrong_shape = dict(buffers, **{"columnwise.scale_inv": torch.zeros(1, 64, dtype=torch.uint8)})
    with pytest.raises(ValueError, match=r"columnwise.scale_inv: expected uint8 of shape \[2, 64\]"):
        qtensor.QuantizedTensor.from_buffers(wrong_shape, metadata)
    wrong_dtype = dict(buffers, **{"rowwise.data": buffers["rowwise.data"].view(torch.uint8)})
    with pytest.raises(ValueError, match="rowwise.data: expected float8_e4m3fn"):
        qtensor.QuantizedTensor.from_buffers(wrong_dtype, metadata)
    missing = {n: b for n, b in buffers.items() if n != "rowwise.scale_inv"}
    with pytest.raises(ValueError, match=r"missing \['rowwise.scale_inv'\]"):
        qtensor.QuantizedTensor.from_buffers(missing, metadata)


def test_flatten_and_unflatten_behave_as_on_any_tensor():
    q = qtensor.NVFP4Quantizer().quantize(sample(4, 16, 32))
    flat = q.flatten()  # the dequantized values, computed when used (ops.DequantizedView)
    assert not isinstance(flat, qtensor.QuantizedTensor) and torch.equal(flat, q.dequantize().flatten())
    assert type(flat * 1) is torch.Tensor and flat.shape == (4 * 16 * 32,)
    assert torch.equal(q.unflatten(-1, (2, 16)), q.dequantize().unflatten(-1, (2, 16)))
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))
    qtensor.quantize_(model, qtensor.recipes.mxfp8(), weights="quantized")
    total = torch.cat([p.flatten() for p in model.parameters()])
    assert total.numel() == sum(p.numel() for p in model.parameters())


def test_quantizers_compare_and_hash_by_configuration():
    assert qtensor.Float8Quantizer() == qtensor.Float8Quantizer()
    assert hash(qtensor.MXFP8Quantizer()) == hash(qtensor.MXFP8Quantizer())
    assert qtensor.MXFP8Quantizer() != qtensor.MXFP8Quantizer(scale_rounding="floor")
    assert qtensor.Float8Quantizer() != qtensor.MXFP8Quantizer()
    hybrid = lambda rht: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer(rht=rht))  # noqa: E731
    assert hybrid(True) == hybrid(True) and hybrid(True) != hybrid(False)
    delayed = qtensor.Float8Quantizer(scaling="delayed")
    before = hash(delayed)
    delayed.quantize(sample(8, 8))
    assert hash(delayed) == before and delayed == qtensor.Float8Quantizer(scaling="delayed")  # state is not configuration
    assert len({qtensor.NVFP4Quantizer(), qtensor.NVFP4Quantizer(), qtensor.NVFP4Quantizer(rht=True)}) == 2
    # Equal quantizers share one kept key (compared by identity at every compiled call); a changed
    # option makes the key again, and the quantizers then differ; changed back, they are equal again.
    a, b = qtensor.MXFP8Quantizer(), copy.deepcopy(qtensor.MXFP8Quantizer())
    assert a == b and a.config_key() is b.config_key()
    b.scale_rounding = "floor"
    assert a != b and b == qtensor.MXFP8Quantizer(scale_rounding="floor")
    b.scale_rounding = a.scale_rounding
    assert a == b and a.config_key() is b.config_key()


def _contains_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_contains_tensor(v) for v in value)
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        return any(_contains_tensor(getattr(value, f)) for f in value.__dataclass_fields__)
    return False


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_flatten_context_is_hashable_by_value_and_holds_no_shape_or_tensors(fmt):
    a = FORMATS[fmt]().quantize(sample(3, 16, 48))
    b = FORMATS[fmt]().quantize(sample(5, 32, 48, seed=3))  # another shape, other values, new quantizer
    names_a, context_a = a.__tensor_flatten__()
    names_b, context_b = b.__tensor_flatten__()
    assert names_a == names_b and context_a == context_b
    assert hash(context_a) == hash(context_b)
    assert not _contains_tensor(context_a[0])  # and no shape: the two tensors' shapes differ, their contexts do not
    rebuilt = type(a).__tensor_unflatten__({n: getattr(a, n) for n in names_a}, context_a, a.shape, None)
    assert type(rebuilt) is type(a) and rebuilt.shape == a.shape and all_buffers_equal(rebuilt, a)
    assert rebuilt.shared_buffer_names() == a.shared_buffer_names()


def test_a_split_piece_keeps_its_slice_flag_through_flatten():
    top, _ = qtensor.Float8Quantizer().quantize(sample(64, 16)).split(32)
    names, context = top.__tensor_flatten__()
    rebuilt = type(top).__tensor_unflatten__({n: getattr(top, n) for n in names}, context, top.shape, None)
    assert rebuilt.rowwise.row_slice


def test_storage_bytes_count_each_shared_buffer_once():
    rows, cols = 40, 24
    x = sample(rows, cols)
    assert qtensor.Float8Quantizer().quantize(x).storage_nbytes() == 2 * rows * cols + 4
    nbytes = math.prod((rows, ceil(cols, 2))) + rows * ceil(cols, 16) + cols * ceil(rows, 2) + cols * ceil(rows, 16)
    assert qtensor.NVFP4Quantizer().quantize(x).storage_nbytes() == nbytes + 4
    assert qtensor.NVFP4Quantizer(rht=True).quantize(x).storage_nbytes() == nbytes - cols * ceil(rows, 2) + cols * 8 * ceil(rows, 16) + 8
