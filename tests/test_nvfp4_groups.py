"""NVFP4's grouped casts (formats/nvfp4_groups.py): every group of a grouped GEMM's routed rows, or
every expert of a stack, cast at once, each group getting the bytes of its own cast: its own
global amax, tiles and Hadamard runs counted from its first row, and under stochastic rounding its
own keys with the draws numbered as in its own cast. On the CPU the reference places each group's
cast; on a GPU the kernels (qtensor_kernels/nvfp4_groups.py) write them, checked here against the
dense cast of each group alone (itself checked against the numpy oracle in test_nvfp4.py)."""

from unittest import mock

import pytest
import torch

import qtensor
from qtensor.core.groups import RowGroups
from test_linear import varied

QUANTIZERS = {
    "1x16": dict(),
    "rht": dict(rht=True),
    "16x16 tiles": dict(block_2d=True),
    "rht, stochastic": dict(rht=True, stochastic_rounding=True),
    "stochastic": dict(stochastic_rounding=True),
}
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def bits(t):
    return t.view(torch.uint8)


def assert_each_group_is_its_own_cast(quantizer, x, lengths, keys):
    """The grouped casts of `x` in groups `lengths` against `quantizer.quantize` of each group alone
    under its row of `keys`: codes, scales and global amaxes, and zero codes in the padding."""
    ends = torch.tensor(lengths, device=x.device).cumsum(0)
    groups = RowGroups(lengths, ends, align=16)
    with mock.patch.object(torch, "randint", return_value=keys):
        row, col = quantizer.quantize_padded_groups(x, groups, True, True, (True, True))
    for copy in (row, col):  # values the GPU's cast writes beside the codes: the codes' bf16 operand, bit for bit
        if x.device.type == "cuda":
            assert copy.values is not None and torch.equal(copy.values.view(torch.int16), copy.storage.bf16_operand()[0].view(torch.int16))
    # 16x16 tiles keep one scale each where every group is whole tiles; compared per block here
    tiles = quantizer.block_2d and all(n % 16 == 0 for n in lengths)
    assert row.storage.tile_scales == tiles and col.storage.tile_scales == tiles
    row_data, row_scales = row.storage.data, row.storage.block_scales()
    col_data, col_scales = col.storage.data, col.storage.block_scales()
    start = run = 0
    for group, length in enumerate(lengths):
        runs = -(-length // 16)
        if length:
            with mock.patch.object(quantizer, "_draw_keys", return_value=None if keys is None else keys[group]):
                alone = quantizer.quantize(x[start:start + length])
            assert torch.equal(bits(row_data[start:start + length]), bits(alone.rowwise.data))
            assert torch.equal(bits(row_scales[start:start + length]), bits(alone.rowwise.block_scales()))
            assert torch.equal(row.group_scales[group], alone.rowwise.global_amax)
            stored = alone.columnwise.data.shape[1]
            assert torch.equal(bits(col_data[:, 8 * run:8 * run + stored]), bits(alone.columnwise.data))
            assert not bits(col_data[:, 8 * run + stored:8 * (run + runs)]).any()
            assert torch.equal(bits(col_scales[:, run:run + runs]), bits(alone.columnwise.block_scales()))
            assert torch.equal(col.group_scales[group], alone.columnwise.global_amax)
        else:
            assert row.group_scales[group] == 0 and col.group_scales[group] == 0
        start, run = start + length, run + runs
    assert col_data.shape[1] == 8 * run and col_scales.shape[1] == run


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", list(QUANTIZERS))
def test_every_group_gets_the_bytes_of_its_own_cast(options, device):
    """Groups of any length (empty ones, 5, 37 and 30 rows: partial runs of 16), NaN and ±Inf among
    the values, bf16 and fp32 inputs, each option of the format."""
    quantizer = qtensor.NVFP4Quantizer(**QUANTIZERS[options])
    lengths = (0, 37, 64, 5, 0, 30)
    stochastic = quantizer.stochastic_rounding
    keys = torch.randint(0, 2**32, (len(lengths), 4), generator=torch.Generator().manual_seed(7), dtype=torch.int64).to(device) if stochastic else None
    for dtype in (torch.float32, torch.bfloat16):
        x = varied(sum(lengths), 80, seed=4).to(device, dtype)
        x[3, 4], x[40, 2], x[41, 70] = float("inf"), float("nan"), float("-inf")
        assert_each_group_is_its_own_cast(quantizer, x, lengths, keys)


@pytest.mark.parametrize("device", DEVICES)
def test_a_stack_of_experts_casts_as_groups_of_its_rows(device):
    """An expert stack [E, N, K] as [E·N, K] in groups of N rows: each expert its own cast (the
    weights' 16x16 tiles), an expert of zeros included (its tensor scale is 1)."""
    quantizer = qtensor.NVFP4Quantizer(block_2d=True)
    stack = varied(3, 48, 96, seed=5).to(device)
    stack[1] = 0
    assert_each_group_is_its_own_cast(quantizer, stack.reshape(-1, 96), (48, 48, 48), None)


def test_one_draw_gives_every_group_its_keys():
    """Stochastic rounding draws [G, 4] keys at once from the quantizer's generator (a seed
    reproduces the cast) and group g rounds under row g: two casts with one seed are equal, and
    group g equals its own cast under row g of the same draw."""
    lengths = (20, 0, 16)
    x = varied(sum(lengths), 32, seed=6)
    groups = RowGroups(lengths, torch.tensor(lengths).cumsum(0), align=16)
    first, second = (qtensor.NVFP4Quantizer(stochastic_rounding=True, seed=3).quantize_padded_groups(x, groups, True, True) for _ in range(2))
    assert torch.equal(bits(first[0].storage.data), bits(second[0].storage.data))
    keys = torch.randint(0, 2**32, (3, 4), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    assert_each_group_is_its_own_cast(qtensor.NVFP4Quantizer(stochastic_rounding=True), x, lengths, keys)
    with mock.patch.object(torch, "randint", return_value=keys):
        again = qtensor.NVFP4Quantizer(stochastic_rounding=True).quantize_padded_groups(x, groups, True, False)[0]
    assert torch.equal(bits(again.storage.data), bits(first[0].storage.data))
