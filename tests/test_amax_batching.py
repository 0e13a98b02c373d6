"""What FSDP2's batched amax reduction relies on (docs/fsdp2.md): each quantizer's `tensor_amaxes`
lists exactly the local amaxes its cast of one shard reduces, in the order the cast asks for them,
and a cast handed those amaxes already reduced (`numerics.sharded_cast(groups, reduced=...)`) writes the same bytes
as one that reduces them itself. A count that does not match raises.

On the CPU (the reference casts) and, where there is one, on a CUDA GPU (the kernels' casts). The
multi-rank counts and exactness are in test_fsdp.py.
"""

import pytest
import torch

from qtensor import Float8Quantizer, HybridQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer
from qtensor.core import running_state
from qtensor.core.numerics import sharded_cast
from qtensor.core.quantizer import Quantizer

QUANTIZERS = {
    "float8_current": lambda: Float8Quantizer(),
    "float8_current_epsilon_pow2": lambda: Float8Quantizer(torch.float8_e5m2, amax_epsilon=1e-3, force_pow_2_scales=True),
    "float8_delayed": lambda: Float8Quantizer(scaling="delayed"),
    "mxfp8": lambda: MXFP8Quantizer(),
    "nvfp4": lambda: NVFP4Quantizer(),
    "nvfp4_2d": lambda: NVFP4Quantizer(block_2d=True),
    "nvfp4_rht": lambda: NVFP4Quantizer(rht=True),
    "nvfp4_rht_stochastic": lambda: NVFP4Quantizer(rht=True, stochastic_rounding=True, seed=5),
    "identity": lambda: IdentityQuantizer(),
    "hybrid": lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()),
    "hybrid_rht": lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(rht=True)),
    "hybrid_nvfp4_float8": lambda: HybridQuantizer(NVFP4Quantizer(rht=True), Float8Quantizer()),
}
DIRECTIONS = {"both": (True, True), "rowwise": (True, False), "columnwise": (False, True)}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
GROUP = object()  # stands for a process group: all_reduce is replaced below


def weight_like(rows: int, cols: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows * 1000 + cols)
    scale = torch.exp2(torch.randint(-6, 6, (rows, 1), generator=generator).float())
    x = torch.randn(rows, cols, generator=generator) * scale
    if rows > 3:
        x[1, 2], x[3, 0] = float("inf"), float("nan")  # not finite: no part of any amax
    return x.to(dtype).to(device)


def cast_reducing(quantizer, x, rowwise, columnwise, monkeypatch):
    """The cast of one shard that reduces its own amaxes, and the local amaxes it handed to all_reduce."""
    handed = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, *args, **kwargs: handed.append(tensor.clone()))
    with running_state.noting(), sharded_cast(GROUP):
        cast = quantizer.copy().quantize(x, rowwise=rowwise, columnwise=columnwise)
    monkeypatch.undo()
    return cast, handed


def buffer_bytes(tensor) -> dict:
    return {name: buffer.reshape(-1).view(torch.uint8).cpu() for name, buffer in tensor.buffer_dict(quantizer_state=False).items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("name", QUANTIZERS)
def test_tensor_amaxes_are_what_the_cast_reduces_and_the_cast_takes_them_reduced(name, direction, dtype, device, monkeypatch):
    rowwise, columnwise = DIRECTIONS[direction]
    for rows, cols in ((64, 96), (48, 40), (0, 32)):  # an empty shard: a rank past the last row
        quantizer = QUANTIZERS[name]()
        x = weight_like(rows, cols, dtype, device)
        cast, handed = cast_reducing(quantizer, x, rowwise, columnwise, monkeypatch)
        declared = quantizer.tensor_amaxes(x, rowwise, columnwise)
        assert declared is not None
        assert len(declared) == len(handed), (rows, cols)
        for mine, theirs in zip(declared, handed):
            assert mine.dtype == torch.float32 and mine.device == x.device
            assert torch.equal(mine.reshape(()), theirs.reshape(())), (rows, cols, mine, theirs)
        with running_state.noting(), sharded_cast(GROUP, reduced=declared, owner=name):
            taken = quantizer.copy().quantize(x, rowwise=rowwise, columnwise=columnwise)
        mine, theirs = buffer_bytes(taken), buffer_bytes(cast)
        assert mine.keys() == theirs.keys()
        for buffer in theirs:
            assert torch.equal(mine[buffer], theirs[buffer]), (rows, cols, buffer)


def test_a_columnwise_copy_made_from_the_rowwise_one_declares_nothing():
    """Its amaxes are known only once the rowwise copy is cast: such a cast reduces its own."""
    hybrid = HybridQuantizer(NVFP4Quantizer(), NVFP4Quantizer(), columnwise_source="rowwise_dequantized")
    x = weight_like(32, 32, torch.float32, "cpu")
    assert hybrid.tensor_amaxes(x, True, True) is None
    assert hybrid.tensor_amaxes(x, False, True) is None
    assert len(hybrid.tensor_amaxes(x, True, False)) == 1


def test_a_quantizer_that_declares_nothing_is_not_batched():
    class Undeclared(Quantizer):
        format_name = ""  # not registered

        def _quantize_2d(self, x, rowwise, columnwise, *, update_state=True):
            raise NotImplementedError

    assert Undeclared().tensor_amaxes(torch.ones(2, 2), True, True) is None


def test_a_cast_that_takes_more_or_fewer_amaxes_than_were_reduced_raises():
    x = weight_like(32, 32, torch.float32, "cpu")
    amax = x[torch.isfinite(x)].abs().max()
    with pytest.raises(RuntimeError, match="layer.weight: its cast asks for more tensor-wide amaxes than the 0"):
        with sharded_cast(GROUP, reduced=[], owner="layer.weight"):
            Float8Quantizer().quantize(x)
    with pytest.raises(RuntimeError, match="layer.weight: its cast took 1 tensor-wide amaxes of the 2"):
        with sharded_cast(GROUP, reduced=[amax, amax], owner="layer.weight"):
            Float8Quantizer().quantize(x)
    with sharded_cast(GROUP, reduced=[amax], owner="layer.weight"):
        Float8Quantizer().quantize(x)  # exactly one: fine
