"""NVFP4's stochastic rounding: the random draws, counter-based so that the GPU kernels and the
pure-torch reference draw the same numbers (docs/numerics.md, NVFP4)."""

import torch

# Counter-based, so the CUDA kernel and this reference draw the same numbers: a cast takes two 32-bit
# keys per direction from torch's generator (`draw_keys`, on the tensor's device: no host sync). In
# the matrix quantized along its rows, elements 2j and 2j+1 of row r make pair p = r*ceil(cols/2) + j,
# whose hash
#     h = mix(lo(p) ^ k0 ^ mix(hi(p) ^ k1))
# gives element 2j the draw (h & 0xFFFF) * 2**-16 and element 2j+1 the draw (h >> 16) * 2**-16; mix
# is a 32-bit xor-shift-multiply finaliser (a bijection, so no two pairs of one 2**32 run share a
# hash). 16 bits resolve the rounding probability to 2**-16 of a grid step, one hash serves two
# elements, and both elements of a pair sit in one GPU thread in either direction.
# A seed, through torch.manual_seed or the quantizer's own generator, reproduces a cast.
_MIX_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
_LOW32 = 0xFFFFFFFF


def draw_keys(generator: torch.Generator | None, device) -> torch.Tensor:
    """Four 32-bit keys (int64): k0, k1 of the rowwise copy, then those of the columnwise copy."""
    return torch.randint(0, 2**32, (4,), generator=generator, device=device, dtype=torch.int64)


def _times_mod_2_32(h: torch.Tensor, multiplier: int) -> torch.Tensor:
    """(h * multiplier) mod 2**32 in int64 without overflow, by 16-bit halves of the multiplier."""
    low, high = multiplier & 0xFFFF, multiplier >> 16
    return (h * low + (((h * high) & 0xFFFF) << 16)) & _LOW32


def mix32(h: torch.Tensor) -> torch.Tensor:
    """The 32-bit finaliser of the draws, on int64 holding values in [0, 2**32)."""
    h = _times_mod_2_32(h ^ (h >> 16), _MIX_MULTIPLIERS[0])
    h = _times_mod_2_32(h ^ (h >> 15), _MIX_MULTIPLIERS[1])
    return h ^ (h >> 15)


def uniform_draws(keys: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """fp32 draws in [0, 1), multiples of 2**-16, for the [rows, cols] matrix under `keys` (k0, k1)."""
    pairs = (cols + 1) // 2
    p = torch.arange(rows, device=keys.device, dtype=torch.int64)[:, None] * pairs + torch.arange(pairs, device=keys.device)
    h = mix32((p & _LOW32) ^ keys[0] ^ mix32((p >> 32) ^ keys[1]))
    halves = torch.stack((h & 0xFFFF, h >> 16), dim=-1).reshape(rows, 2 * pairs)[:, :cols]
    return halves.float() * 2.0**-16
