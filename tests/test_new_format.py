"""A new format needs its own module under qtensor/formats and nothing else (docs/architecture.md).

The format below is written as a contributor would write `qtensor/formats/int8_rows.py` (its classes
say that module is theirs): symmetric int8 with one fp32 scale per row of each direction's copy.
Nothing else in qtensor is changed, and the format then quantizes, slices, pickles, saves to
safetensors and trains a stock model through `quantize_`. Checked against a numpy reference of the
format written from its definition here.
"""

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtensor
from qtensor.core.plan import TENSOR_CLASSES
from qtensor.core.quantizer import QUANTIZER_CLASSES, Quantizer
from qtensor.core.storage import STORAGE_CLASSES, Buffer, Storage
from qtensor.core.tensor import QuantizedTensor

MODULE = "qtensor.formats.int8_rows"  # where a contributor would put it


def define_format():
    class Int8RowsStorage(Storage):
        """`data` int8 [rows, cols] in both directions; `scale_inv` fp32: one per row (rowwise,
        [rows]) or one per column (columnwise, [cols], which covers every row: tensor-wide)."""

        format_name = "int8_rows"
        option_values = {}

        @classmethod
        def layout(cls, direction, rows, cols):
            data = Buffer("data", torch.int8, (rows, cols), row_axis=0, col_axis=1)
            if direction == "rowwise":
                return (data, Buffer("scale_inv", torch.float32, (rows,), row_axis=0, col_axis=None))
            return (data, Buffer("scale_inv", torch.float32, (cols,), row_axis=None, col_axis=0))

        def dequantize(self):
            scale = self.scale_inv[:, None] if self.direction == "rowwise" else self.scale_inv[None, :]
            return self.data.float() * scale

    class Int8RowsTensor(QuantizedTensor):
        pass

    class Int8RowsQuantizer(Quantizer):
        format_name = "int8_rows"
        tensor_class = Int8RowsTensor

        def __init__(self):
            pass

        def _quantize_2d(self, x, rowwise, columnwise, *, update_state=True):
            x = x.float()
            rows, cols = x.shape

            def cast(direction, dim):
                amax = x.abs().amax(dim=dim)
                scale_inv = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
                scale = scale_inv[:, None] if dim == 1 else scale_inv[None, :]
                data = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
                return Int8RowsStorage(direction=direction, rows=rows, cols=cols, data=data, scale_inv=scale_inv)

            return (cast("rowwise", 1) if rowwise else None, cast("columnwise", 0) if columnwise else None)

    for cls in (Int8RowsStorage, Int8RowsTensor, Int8RowsQuantizer):
        cls.__module__ = MODULE
    TENSOR_CLASSES[Int8RowsTensor.__name__] = Int8RowsTensor  # what defining it in MODULE registers
    return Int8RowsQuantizer, Int8RowsTensor


@pytest.fixture
def new_format():
    registries = [dict(TENSOR_CLASSES), dict(STORAGE_CLASSES), dict(QUANTIZER_CLASSES)]
    yield define_format()
    for registry, before in zip((TENSOR_CLASSES, STORAGE_CLASSES, QUANTIZER_CLASSES), registries):
        registry.clear()
        registry.update(before)


def reference(x: np.ndarray, axis: int) -> np.ndarray:
    """The format's values, from its definition: round(x / s) clipped to ±127, times s = amax / 127."""
    amax = np.abs(x).max(axis=axis, keepdims=True)
    scale = np.where(amax > 0, (amax / np.float32(127)).astype(np.float32), np.float32(1))
    return (np.clip(np.round(x / scale), -127, 127) * scale).astype(np.float32)


def test_a_format_in_its_own_module_quantizes_slices_and_round_trips(new_format, tmp_path):
    quantizer_class, tensor_class = new_format
    x = torch.randn(64, 48)
    q = quantizer_class().quantize(x)
    assert isinstance(q, tensor_class) and q.shape == x.shape
    np.testing.assert_allclose(q.dequantize(direction="rowwise").numpy(), reference(x.numpy(), 1), rtol=1e-6, atol=0)
    np.testing.assert_allclose(q.dequantize(direction="columnwise").numpy(), reference(x.numpy(), 0), rtol=1e-6, atol=0)
    top, bottom = q.split(32)
    assert isinstance(top, tensor_class) and torch.equal(torch.cat([top.dequantize(), bottom.dequantize()]), q.dequantize())
    assert torch.equal(q.clone().dequantize(), q.dequantize()) and isinstance(q.to(torch.float32), tensor_class)
    buffer = io.BytesIO()
    torch.save(q, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded) is tensor_class and torch.equal(loaded.dequantize(), q.dequantize())
    qtensor.save_file({"q": q}, tmp_path / "q.safetensors")
    restored = qtensor.load_file(tmp_path / "q.safetensors")["q"]
    assert type(restored) is tensor_class and torch.equal(restored.rowwise.data, q.rowwise.data)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_a_format_in_its_own_module_trains_a_stock_model(new_format, weights):
    quantizer_class, tensor_class = new_format
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    plain = [(layer.weight.detach().clone(), layer.bias.detach().clone()) for layer in (model[0], model[2])]
    report = qtensor.quantize_(model, lambda role: quantizer_class(), weights=weights)
    assert len(report.quantized) == 2
    x = torch.randn(8, 32)
    y = model(x)
    # The forward GEMMs multiply each operand's rowwise values (the reference of the format).
    h = x.numpy()
    for index, (weight, bias) in enumerate(plain):
        w = weight.numpy() if weights == "dynamic" else reference(weight.numpy(), 1)
        h = reference(h, 1) @ reference(w, 1).T + bias.numpy()
        if index == 0:
            h = F.gelu(torch.from_numpy(h)).numpy()
    np.testing.assert_allclose(y.detach().numpy(), h, rtol=1e-4, atol=1e-5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if weights == "quantized":
        optimizer = qtensor.optim.MasterWeights(optimizer)
        assert isinstance(model[0].weight, tensor_class)
    before = [p.detach().clone() if not isinstance(p, QuantizedTensor) else p.dequantize() for p in model.parameters()]
    qtensor.gemm.backend_counts(reset=True)
    model(x).square().mean().backward()
    assert qtensor.gemm.backend_counts() == {"reference": 5}  # fprop and wgrad of both layers, dgrad of the second
    optimizer.step()
    after = [p.detach() if not isinstance(p, QuantizedTensor) else p.dequantize() for p in model.parameters()]
    assert all(not torch.equal(b, a) for b, a in zip(before, after))  # every parameter trained
