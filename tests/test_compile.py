"""torch.compile over quantized tensors: the flatten context lets the compiler guard on them.

Each type's `dequantize` compiles with fullgraph=True (no graph break) and runs again on a new
tensor with new values without recompiling; the compiled result equals the eager one.
"""

import pytest
import torch
import torch._dynamo.testing

import qtensor

TYPES = {
    "Float8Tensor": lambda: qtensor.Float8Quantizer(scaling="delayed"),
    "MXFP8Tensor": lambda: qtensor.MXFP8Quantizer(),
    "NVFP4Tensor": lambda: qtensor.NVFP4Quantizer(rht=True),
    "IdentityTensor": lambda: qtensor.IdentityQuantizer(),
    "HybridQuantizedTensor": lambda: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer()),
}


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_compiles_fullgraph_without_recompiling_for_new_values(name):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q: q.dequantize() * 2, fullgraph=True, backend=counter)
    quantizer = TYPES[name]()
    for seed in range(2):
        x = torch.randn(64, 96, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        q = quantizer.quantize(x)  # a new tensor with new values (and, for delayed scaling, a moved history)
        assert type(q).__name__ == name
        assert torch.equal(compiled(q).nan_to_num(), (q.dequantize() * 2).nan_to_num())
    assert counter.frame_count == 1


def test_a_slice_compiles_and_keeps_its_format():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q: q[32:].dequantize(), fullgraph=True, backend=counter)
    q = qtensor.MXFP8Quantizer().quantize(torch.randn(64, 32))
    assert torch.equal(compiled(q), q.dequantize()[32:])
