"""Shared input generators for the numerics tests.

Inputs are built in numpy (fp32) with a fixed seed per call and returned as torch tensors of the
requested dtype; every value is exactly representable in that dtype, so the oracle and the library
see the same numbers. Magnitudes vary from one 16x16 tile to the next, so rowwise and columnwise
blocks of MXFP8 (32) and NVFP4 (16) both see mixed scales.
"""

import os
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

# lets the test modules `import oracle` whatever pytest import mode is in use
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workers  # noqa: E402

# The subprocess runs (gloo ranks, torchrun, the demo) that the selected tests wait for start while
# the tests before them run: workers.Background.
_EARLY = workers.EarlyStarts()


def pytest_collection_finish(session):
    _EARLY.collected(session.items)


def pytest_runtest_setup(item):
    _EARLY.next()


def pytest_sessionfinish(session):
    _EARLY.stop()

TILE = 16
_NUMPY_DTYPE = {torch.float32: np.float32, torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16}
# tile exponent range per dtype: 2**[-20, 20] where the dtype has the range, narrower for fp16
_EXPONENTS = {torch.float32: (-20, 20), torch.bfloat16: (-20, 20), torch.float16: (-10, 10)}
_HUGE = {torch.float32: 3.0e38, torch.bfloat16: 3.0e38, torch.float16: 6.0e4}
_TINY = {torch.float32: 1e-41, torch.bfloat16: 1e-39, torch.float16: 2.0**-23}


def to_torch(values, dtype):
    """fp32 numpy -> torch tensor of `dtype`; values must already be representable."""
    narrow = np.asarray(values, np.float32).astype(_NUMPY_DTYPE[dtype])
    assert np.array_equal(narrow.astype(np.float32), values, equal_nan=True), "value not representable"
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)


def _round(values, dtype):
    """Round fp32 values into `dtype` (so generated data is representable)."""
    with np.errstate(over="ignore"):
        return np.asarray(values, np.float32).astype(_NUMPY_DTYPE[dtype]).astype(np.float32)


def tile_map(shape2d, per_tile, tile=TILE):
    """Expand per-tile values [ceil(M/tile), ceil(K/tile)] to a per-element [M, K] map."""
    rows, cols = shape2d
    return np.repeat(np.repeat(per_tile, tile, axis=0), tile, axis=1)[:rows, :cols]


def _tile_diagonal(shape2d, tile):
    """True at one position of every row and every column of each tile (partial tiles included)."""
    rows, cols = shape2d
    i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
    h = np.minimum(tile, rows - (i // tile) * tile)  # height of this element's tile
    w = np.minimum(tile, cols - (j // tile) * tile)
    n = np.minimum(h, w)
    return (i % tile) % n == (j % tile) % n


def _as_2d(shape):
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return rows, shape[-1]


class Inputs:
    """Test data. `make(kind, shape, dtype)` kinds: varied, special, extremes, all_tiny, zeros;
    plus exact-tie builders per format and exactly transformable data for the RHT."""

    def make(self, kind, shape, dtype, seed=0):
        rng = np.random.default_rng(seed)
        m, k = _as_2d(shape)
        x = getattr(self, "_" + kind)(rng, (m, k), dtype)
        return to_torch(_round(x, dtype).reshape(shape), dtype)

    def _varied(self, rng, shape2d, dtype):
        lo, hi = _EXPONENTS[dtype]
        tiles = (-(-shape2d[0] // TILE), -(-shape2d[1] // TILE))
        exponents = tile_map(shape2d, rng.integers(lo, hi + 1, size=tiles))
        return rng.standard_normal(shape2d).astype(np.float32) * np.exp2(exponents).astype(np.float32)

    def _special(self, rng, shape2d, dtype):
        """Varied data plus scattered zeros, an all-zero 32x32 corner, a tiny block, NaN and ±Inf."""
        x = self._varied(rng, shape2d, dtype)
        m, k = shape2d
        x[rng.random(shape2d) < 0.05] = 0
        x[:32, :32] = 0
        tiny_cols = slice(32, 48) if k > 32 else slice(0, 16)
        tiny = x[max(0, m - TILE):, tiny_cols]  # a view: the last rows' block becomes subnormal-range
        tiny[...] = rng.standard_normal(tiny.shape) * _TINY[dtype]
        x[m // 2, k - 1] = np.nan
        x[m - 1, 0] = np.inf
        x[min(m - 1, 5), k // 2] = -np.inf
        return x

    def _extremes(self, rng, shape2d, dtype):
        """Small-spread data with one tile near the dtype's max and one of (sub)normal-range tiny values."""
        m, k = shape2d
        x = rng.standard_normal(shape2d).astype(np.float32)
        x[:TILE, -TILE:] = np.clip(rng.standard_normal((min(m, TILE), min(k, TILE))), -1, 1) * _HUGE[dtype]
        x[-TILE:, :TILE] = rng.standard_normal((min(m, TILE), min(k, TILE))) * _TINY[dtype]
        return x

    def _all_tiny(self, rng, shape2d, dtype):
        """Only subnormal-range values: tensor scales overflow to FLT_MAX, E8M0 codes hit 0."""
        return rng.standard_normal(shape2d).astype(np.float32) * _TINY[dtype]

    def _zeros(self, rng, shape2d, dtype):
        return np.zeros(shape2d, np.float32)

    # ---- exact ties, per format ------------------------------------------------------------

    def float8_ties(self, fp8, shape, dtype, exponent=0, seed=0):
        """Every midpoint between neighbouring positive fp8 values (and every value), random signs,
        times 2**exponent, with one element ±fp8_max * 2**exponent: the scale is exactly 2**-exponent,
        so each midpoint is an exact tie after scaling."""
        rng = np.random.default_rng(seed)
        narrow = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fp8]
        values = np.arange(256, dtype=np.uint8).view(narrow).astype(np.float32)
        values = np.unique(values[np.isfinite(values) & (values >= 0)])
        candidates = np.concatenate([(values[:-1] + values[1:]) / 2, values]).astype(np.float32)
        m, k = _as_2d(shape)
        x = rng.choice(candidates, size=(m, k)) * rng.choice([-1, 1], size=(m, k))
        x.flat[rng.integers(m * k)] = values[-1]
        return to_torch((x * 2.0**exponent).astype(np.float32).reshape(shape), dtype)

    def mxfp8_ties(self, fp8, shape, dtype, seed=0):
        """32x32 tiles at exponent e (random per tile) whose every row and column holds ±fp8_max*2**e:
        each block's scale is exactly 2**-e in both directions and both rules, and the other elements
        are fp8 midpoints (exact ties) or fp8 values times 2**e."""
        rng = np.random.default_rng(seed)
        narrow, fp8_max = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}[fp8]
        values = np.arange(256, dtype=np.uint8).view(narrow).astype(np.float32)
        values = np.unique(values[np.isfinite(values) & (values >= 0)])
        candidates = np.concatenate([(values[:-1] + values[1:]) / 2, values]).astype(np.float32)
        m, k = _as_2d(shape)
        lo, hi = (-20, 20) if dtype != torch.float16 else (-6, 0)
        exponents = tile_map((m, k), rng.integers(lo, hi + 1, size=(-(-m // 32), -(-k // 32))), tile=32)
        x = rng.choice(candidates, size=(m, k))
        x = np.where(_tile_diagonal((m, k), 32), fp8_max, x) * rng.choice([-1, 1], size=(m, k))
        return to_torch((x * np.exp2(exponents)).astype(np.float32).reshape(shape), dtype)

    def nvfp4_ties(self, shape, dtype, seed=0):
        """16x16 tiles at exponent e in [-9, 8] whose every row and column holds ±6*2**e, the rest
        E2M1 ties (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) or values times 2**e; one element is 2688
        so S_enc = 1 and each tie block's scale is exactly 2**e (f = 2**-e)."""
        rng = np.random.default_rng(seed)
        candidates = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
        m, k = _as_2d(shape)
        exponents = tile_map((m, k), rng.integers(-9, 9, size=(-(-m // TILE), -(-k // TILE))))
        x = rng.choice(candidates, size=(m, k))
        x = np.where(_tile_diagonal((m, k), TILE), 6, x) * rng.choice([-1, 1], size=(m, k))
        x = (x * np.exp2(exponents)).astype(np.float32)
        x[0, 0] = 2688
        return to_torch(x.reshape(shape), dtype)

    def rht_exact(self, shape, dtype, seed=0):
        """Small integers times 2**e, e fixed per 16x16 tile: the 16-point Hadamard transform of
        every column group is exact in fp32, whatever the summation order."""
        rng = np.random.default_rng(seed)
        m, k = _as_2d(shape)
        lo, hi = _EXPONENTS[dtype]
        exponents = tile_map((m, k), rng.integers(lo, hi + 1, size=(-(-m // TILE), -(-k // TILE))))
        x = rng.integers(-15, 16, size=(m, k)).astype(np.float32) * np.exp2(exponents).astype(np.float32)
        return to_torch(x.reshape(shape), dtype)


@pytest.fixture
def inputs():
    return Inputs()
