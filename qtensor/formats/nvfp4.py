"""NVFP4: E2M1 elements, an E4M3 scale per 16-element block and an fp32 tensor scale
(docs/numerics.md, NVFP4), with optional 16x16 tiles, random Hadamard transform and stochastic rounding."""

import torch

from ..core.numerics import (
    FLT_MAX,
    amaxes_pre_reduced,
    block_amax,
    ceil_div,
    exact_quotient,
    expand_blocks,
    finite_amax,
    tensor_amax,
    fp32,
    pad_to_multiple,
    reduce_amax,
    scale_from_amax,
    to_fp8_saturating,
)
from ..core.kernels import lookup
from ..core.quantizer import Quantizer
from ..core.storage import BlockScaledOperand, Buffer, Storage, TensorScale
from ..core.tensor import QuantizedTensor
from .nvfp4_draws import draw_keys, uniform_draws
from .nvfp4_groups import cast_groups

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; bit 3 is the sign
# Round-to-nearest-even on the grid: a magnitude above each bound moves up one code. Ties sit on
# the bounds; `>=` at a tie whose upper neighbour has the even code, `>` where the lower one does.
_NEAREST_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


# The two constant tables are built on the tensor's device from integer arithmetic (exact), never
# copied from the host: a host-to-device copy would synchronise every training step.
def e2m1_grid(device) -> torch.Tensor:
    """E2M1_GRID as fp32 on `device`: code bits 0eem: exponent bits e, mantissa bit m → m/2 (e = 0) or 2^(e-1)(1 + m/2)."""
    codes = torch.arange(8, device=device)
    exponent, mantissa = codes >> 1, codes & 1
    # 2^(e-1)(1 + m/2) = ((2 + m) << e) / 4 in integers (exact under any compiler, unlike exp2)
    return torch.where(exponent == 0, mantissa * 0.5, ((2 + mantissa) << exponent) * 0.25)


_RHT_NEGATIVE_MASK = sum(1 << i for i, sign in enumerate(RHT_SIGNS) if sign < 0)


def rht_signs(device) -> torch.Tensor:
    """RHT_SIGNS as fp32 ±1 on `device`."""
    negative = (_RHT_NEGATIVE_MASK >> torch.arange(16, device=device)) & 1
    return (1 - 2 * negative).float()


# ---- numerics ------------------------------------------------------------------------------------
def encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """S_enc = (448 * 6) / global_amax; 1 when global_amax is 0, FLT_MAX when it overflows."""
    return scale_from_amax(global_amax, 448.0 * E2M1_MAX)


def _sign_bit(v: torch.Tensor) -> torch.Tensor:
    """Bit 3 of an E2M1 code: v's sign (-0 included), never a NaN's, whose sign differs between
    devices: the bytes of a block that dequantizes to NaN must not depend on the device."""
    return ((torch.signbit(v) & ~torch.isnan(v)).to(torch.uint8) << 3)


def e2m1_codes_nearest(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (sign in bit 3) of fp32 `v`, round-to-nearest-even, saturating at ±6."""
    magnitude = v.abs()
    codes = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for bound, tie_goes_up in _NEAREST_BOUNDS:
        codes += (magnitude >= bound) if tie_goes_up else (magnitude > bound)
    return codes | _sign_bit(v)


def e2m1_codes_stochastic(v: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """E2M1 codes rounding |v| up to the next grid value when its uniform draw in [0, 1) is below the
    distance to it (in grid steps), down otherwise: unbiased, saturating at ±6."""
    grid = e2m1_grid(v.device)
    magnitude = v.abs().clamp(max=E2M1_MAX)
    lower = torch.zeros(v.shape, dtype=torch.long, device=v.device)
    for value in E2M1_GRID[1:]:
        lower += magnitude >= value
    upper = (lower + 1).clamp(max=7)
    gap = grid[upper] - grid[lower]
    probability_up = torch.where(gap > 0, (magnitude - grid[lower]) / gap, 0.0)
    codes = (lower + (draws < probability_up).long()).to(torch.uint8)
    return codes | _sign_bit(v)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    grid = e2m1_grid(codes.device)
    magnitude = grid[(codes & 0x7).long()]
    # The sign bit set on the magnitude's bits, not a negation: -0 stays -0 also where a compiler
    # lowers -x to 0 - x (Triton does, and so inductor's code for a traced dequantize).
    sign = (codes & 0x8).to(torch.int32) << 28  # bit 3 → bit 31 (int32 wraps to the sign bit)
    return (magnitude.view(torch.int32) | sign).view(torch.float32)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit codes → [R, ceil(C/2)] bytes, element 2i in the low nibble."""
    codes = pad_to_multiple(codes, 2, dim=1)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, columns: int) -> torch.Tensor:
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return codes.reshape(packed.shape[0], 2 * packed.shape[1])[:, :columns]


def quantize_row_blocks(x, s_enc, amax_per_block, keys=None):
    """fp32 `x` [R, C] in blocks of 16 along rows, given each block's amax [R, ceil(C/16)]; with
    `keys` (k0, k1), the elements round stochastically (`uniform_draws`).

    Returns (packed E2M1 bytes [R, ceil(C/2)], E4M3 block scales [R, ceil(C/16)]).
    """
    # A block holding NaN or Inf gets the NaN scale (docs/numerics.md), so it dequantizes to NaN.
    wanted = torch.where(torch.isfinite(amax_per_block), amax_per_block * (s_enc * fp32(1.0 / 6.0, x.device)), float("nan"))
    block_scale = to_fp8_saturating(wanted, torch.float8_e4m3fn)
    decode = block_scale.float() * (fp32(1.0, x.device) / s_enc)
    encode = (fp32(1.0, x.device) / decode).clamp(max=FLT_MAX)
    scaled = x * expand_blocks(encode, BLOCK_SIZE, x.shape[1])
    codes = e2m1_codes_nearest(scaled) if keys is None else e2m1_codes_stochastic(scaled, uniform_draws(keys, *x.shape))
    return pack_nibbles(codes), block_scale


def dequantize_row_blocks(packed, block_scale, s_enc, columns) -> torch.Tensor:
    """Value `(q * float(s)) * (1/S_enc)`, two fp32 products in that order."""
    q = e2m1_values(unpack_nibbles(packed, columns))
    scaled = q * expand_blocks(block_scale.float(), BLOCK_SIZE, columns)
    return scaled * exact_quotient(1.0, s_enc)  # correctly rounded under torch.compile too


def hadamard16(runs: torch.Tensor) -> torch.Tensor:
    """H16 @ v for every run v of 16 along the last dim (Sylvester order), by the fast Walsh-Hadamard
    butterfly: a fixed order of fp32 additions, so every device gives the same bits."""
    shape = runs.shape
    for half in (1, 2, 4, 8):
        pairs = runs.reshape(*shape[:-1], BLOCK_SIZE // (2 * half), 2, half)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        runs = torch.stack((first + second, first - second), dim=-2)
    return runs.reshape(shape)


def apply_rht(x_t: torch.Tensor) -> torch.Tensor:
    """Each run of 16 entries along the rows of `x_t` [K, Mp] (Mp a multiple of 16) becomes H @ run,
    H = diag(signs) · H16 / 4 (orthogonal; the scalings are exact)."""
    signs = rht_signs(x_t.device)
    runs = x_t.reshape(x_t.shape[0], x_t.shape[1] // BLOCK_SIZE, BLOCK_SIZE)
    # "+ 0.0" turns -0 into +0: a sum that cancels to zero has no sign, whatever order made it.
    return (hadamard16(runs) * 0.25 * signs + 0.0).reshape(x_t.shape)


def transformed_columns(x: torch.Tensor) -> torch.Tensor:
    """What a columnwise copy with `rht` quantizes: the transform of `x`ᵀ's rows zero-padded to runs of 16."""
    return apply_rht(pad_to_multiple(x.t(), BLOCK_SIZE, dim=1))


def undo_rht(y_t: torch.Tensor) -> torch.Tensor:
    """Inverse of apply_rht: Hᵀ @ run = H16 @ (signs * run) / 4 (H16 is symmetric)."""
    signs = rht_signs(y_t.device)
    runs = y_t.reshape(y_t.shape[0], y_t.shape[1] // BLOCK_SIZE, BLOCK_SIZE)
    return (hadamard16(runs * signs) * 0.25).reshape(y_t.shape)


def tile_amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| of each 16x16 tile of `x` [R, C]: [ceil(R/16), ceil(C/16)]."""
    padded = pad_to_multiple(pad_to_multiple(x, BLOCK_SIZE, 0), BLOCK_SIZE, 1)
    tiles_r, tiles_c = padded.shape[0] // BLOCK_SIZE, padded.shape[1] // BLOCK_SIZE
    if padded.numel() == 0:
        return padded.new_zeros(tiles_r, tiles_c)
    return padded.abs().reshape(tiles_r, BLOCK_SIZE, tiles_c, BLOCK_SIZE).amax(dim=(1, 3))


class NVFP4Storage(Storage):
    """Rowwise: `data` [rows, ceil(cols/2)] packed E2M1, `scale_inv` [rows, ceil(cols/16)] E4M3.
    Columnwise: the transposed tensor quantized along its rows, `data` [cols, ceil(rows/2)],
    `scale_inv` [cols, ceil(rows/16)]; with `rht` the rows are zero-padded to a multiple of 16
    before the transform and `data` covers the padding ([cols, 8*ceil(rows/16)]).
    With `tile_scales` (a cast in 16x16 tiles) `scale_inv` holds one scale per tile: its scale for
    each 16 stored rows, [ceil(rows/16), ceil(cols/16)] rowwise, [ceil(cols/16), ceil(rows/16)]
    columnwise (`block_scales` repeats them down the rows).
    `global_amax` (0-d fp32) gives the tensor scale S_enc; without `rht` both directions have the
    same one, held once by a tensor that has both."""

    format_name = "nvfp4"
    option_values = {"rht": (False, True), "tile_scales": (False, True)}
    options_added = {"tile_scales": False}  # files written before tiles held one scale each

    @classmethod
    def layout(cls, direction, rows, cols, rht, tile_scales):
        if rht and tile_scales:
            raise ValueError("NVFP4Storage: rht and tile_scales exclude each other (the transform's copy is cast in 1x16 blocks).")
        amax = Buffer("global_amax", torch.float32, (), row_axis=None, col_axis=None)
        per_scale = BLOCK_SIZE if tile_scales else 1  # stored rows one row of scales covers
        if direction == "rowwise":
            return (
                Buffer("data", torch.uint8, (rows, ceil_div(cols, 2)), row_axis=0, col_axis=1, cols_per_entry=2),
                Buffer(
                    "scale_inv", torch.float8_e4m3fn, (ceil_div(rows, per_scale), ceil_div(cols, BLOCK_SIZE)),
                    row_axis=0, rows_per_entry=per_scale, col_axis=1, cols_per_entry=BLOCK_SIZE,
                ),
                amax,
            )
        # With the transform, the bytes cover the rows zero-padded to whole runs of 16.
        pad = BLOCK_SIZE if rht else 1
        length = cls.stored_length_for(direction, rows, cols, rht)
        return (
            Buffer("data", torch.uint8, (cols, ceil_div(length, 2)), row_axis=1, rows_per_entry=2, rows_padded_to=pad, col_axis=0),
            Buffer(
                "scale_inv", torch.float8_e4m3fn, (ceil_div(cols, per_scale), ceil_div(rows, BLOCK_SIZE)),
                row_axis=1, rows_per_entry=BLOCK_SIZE, col_axis=0, cols_per_entry=per_scale,
            ),
            amax,
        )

    @staticmethod
    def stored_length_for(direction, rows, cols, rht) -> int:
        """Elements per row of the stored matrix of a `[rows, cols]` view: cols (rowwise), rows, or
        with `rht` rows zero-padded to whole runs of 16, the transform's (columnwise)."""
        if direction == "rowwise":
            return cols
        return ceil_div(rows, BLOCK_SIZE) * BLOCK_SIZE if rht else rows

    def stored_length(self) -> int:
        """Elements per row of the stored matrix (`stored_length_for`)."""
        return self.stored_length_for(self.direction, self.rows, self.cols, self.rht)

    def scale_rows(self) -> int:
        """Stored rows that one row of `scale_inv` covers: 16 with `tile_scales`, else 1."""
        return BLOCK_SIZE if self.tile_scales else 1

    def block_scales(self) -> torch.Tensor:
        """The E4M3 scale of each block of 16 along the stored rows, [stored rows, ceil(length/16)]:
        `scale_inv`, or with `tile_scales` each tile's scale repeated down its 16 rows."""
        return repeat_rows(self.scale_inv, self.scale_rows(), self.data.shape[0])

    def dequantize(self) -> torch.Tensor:
        length = self.stored_length()
        kernel = lookup("nvfp4.dequantize", self.data)
        if kernel is not None:
            values = kernel(self.data, self.scale_inv, length, torch.float32, self.global_amax, scale_rows=self.scale_rows())
        else:
            values = dequantize_row_blocks(self.data, self.block_scales(), encode_scale(self.global_amax), length)
        if self.direction == "rowwise":
            return values
        if self.rht:
            values = undo_rht(values)
        return values[:, : self.rows].t()

    def bf16_operand(self):
        # q * float(s): an E2M1 value times an E4M3 scale has at most 6 significant bits and lies in
        # [2**-10, 2688], exact in bf16; the fp32 tensor scale 1/S_enc is not, so the GEMM's fp32
        # result takes it. A columnwise copy with `rht` stays in the transformed domain: the other
        # operand must be transformed too (docs/numerics.md, NVFP4: wgrad applies it to both, so it cancels).
        length = self.stored_length()
        kernel = lookup("nvfp4.dequantize", self.data)
        if kernel is not None:
            values = kernel(self.data, self.scale_inv, length, torch.bfloat16, scale_rows=self.scale_rows())
        else:
            q = e2m1_values(unpack_nibbles(self.data, length))
            values = (q * expand_blocks(self.block_scales().float(), BLOCK_SIZE, length)).to(torch.bfloat16)
        return values, self.tensor_scale()

    def block_scaled_operand(self):
        # The packed codes and E4M3 scales as stored; 1/S_enc multiplies the GEMM's fp32 result, as
        # on the bf16 path. A copy in the Hadamard domain has no such form: it stays on the bf16 path.
        if self.reduction_transform() is not None:
            return None
        return BlockScaledOperand(self.data.view(torch.float4_e2m1fn_x2), self.block_scales(), BLOCK_SIZE, self.stored_length(), self.tensor_scale())

    def reduction_transform(self):
        # With `rht` the columnwise copy holds the transformed runs of 16 down the tensor's rows,
        # which its GEMM (wgrad) reduces over.
        return "rht" if self.direction == "columnwise" and self.rht else None

    def tensor_scale(self) -> TensorScale:
        """1/S_enc from the global amax: the factor a value takes after q * float(s)."""
        return TensorScale(self.global_amax, amax_max=448.0 * E2M1_MAX)


def repeat_rows(scales: torch.Tensor, times: int, rows: int) -> torch.Tensor:
    """`scales` with each row repeated `times` times, cut to `rows` rows (any dtype: as bytes)."""
    if times == 1:
        return scales
    entries, width = scales.shape
    as_bytes = scales.view(torch.uint8)[:, None, :].expand(entries, times, width).reshape(entries * times, width)
    return as_bytes[:rows].view(scales.dtype)


def tile_rows(block_scales: torch.Tensor) -> torch.Tensor:
    """The first of each 16 rows of per-row block scales: one row of scales per 16x16 tile."""
    return block_scales[::BLOCK_SIZE].contiguous()


def transposed_tiles(storage: NVFP4Storage, direction: str) -> NVFP4Storage:
    """A copy holding one scale per 16x16 tile (no transform) laid out as the other direction's:
    the codes transposed, the tiles' scales transposed, the global amax shared."""
    codes = unpack_nibbles(storage.data, storage.stored_length()).t()  # [the other direction's stored rows, length]
    return NVFP4Storage(
        direction=direction, rows=storage.rows, cols=storage.cols, rht=False, tile_scales=True,
        data=pack_nibbles(codes.contiguous()), scale_inv=storage.scale_inv.t().contiguous(), global_amax=storage.global_amax,
    )


class NVFP4Tensor(QuantizedTensor):
    """A tensor stored as packed E2M1 codes with E4M3 block scales and an fp32 tensor scale."""


class NVFP4Quantizer(Quantizer):
    """NVFP4 with 1x16 blocks, or 16x16 tiles (`block_2d`, same values in both directions); `rht`
    applies the random Hadamard transform to the columnwise copy; `stochastic_rounding` rounds
    elements stochastically (reproducibly when `seed` is given)."""

    format_name = "nvfp4"
    tensor_class = NVFP4Tensor
    storage_class = NVFP4Storage

    def __init__(self, block_2d: bool = False, rht: bool = False, stochastic_rounding: bool = False, seed=None):
        for option, value in (("block_2d", block_2d), ("rht", rht), ("stochastic_rounding", stochastic_rounding)):
            if not isinstance(value, bool):
                raise ValueError(f"NVFP4Quantizer: {option} must be True or False, got {value!r}.")
        if block_2d and rht:
            raise ValueError(
                "NVFP4Quantizer: block_2d=True and rht=True cannot be combined: 16x16 tiles make both "
                "directions hold the same values, the transform makes them differ. Choose one."
            )
        if seed is not None and not isinstance(seed, int):
            raise ValueError(f"NVFP4Quantizer: seed must be an int or None, got {seed!r}.")
        self.block_2d = block_2d
        self.rht = rht
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def casts_reproducibly(self) -> bool:
        return not self.stochastic_rounding

    def rebuild_direction(self, storage, direction):
        # 16x16 tiles: both copies hold each tile's codes at its one scale, so either is the other
        # transposed (rounded to nearest only: stochastic rounding draws differently by direction).
        # Every tiled cast, and every file read (`current_layout`), holds one scale per tile.
        if direction == storage.direction:
            return storage
        if not self.block_2d or self.stochastic_rounding or not storage.tile_scales:
            return None
        return transposed_tiles(storage, direction)

    def shard_block(self) -> tuple[int, int]:
        rows, cols = super().shard_block()
        # 16x16 tiles share one amax across 16 rows, which the per-row scales do not show.
        return (max(rows, BLOCK_SIZE), cols) if self.block_2d else (rows, cols)

    def _generator(self, device: torch.device) -> torch.Generator | None:
        """One seeded generator per device, advancing with each quantization; None: torch's global RNG."""
        if self.seed is None or not self.stochastic_rounding:
            return None
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def _storage(self, direction, shape, data, scale_inv, global_amax, tile_scales=None) -> NVFP4Storage:
        """A storage over a cast's buffers: scales per 16x16 tile where the quantizer casts in tiles
        (unless `tile_scales` says the cast wrote them per row)."""
        tile_scales = self.block_2d if tile_scales is None else tile_scales
        return NVFP4Storage(direction=direction, rows=shape[0], cols=shape[1], rht=self.rht, tile_scales=tile_scales, data=data, scale_inv=scale_inv, global_amax=global_amax)

    def current_layout(self, storage):
        # A file written before tiles held one scale each repeats each tile's scale down its 16 rows.
        if not self.block_2d or storage.rht or storage.tile_scales:
            return storage
        scales = storage.scale_inv.view(torch.uint8)
        tiles = tile_rows(scales)
        if not torch.equal(repeat_rows(tiles, BLOCK_SIZE, scales.shape[0]), scales):
            raise ValueError(
                f"NVFP4Quantizer(block_2d=True): a stored {storage.direction} copy's scales differ within a 16x16 tile; "
                "it was not cast in tiles. Load it with a quantizer of block_2d=False."
            )
        return NVFP4Storage(
            direction=storage.direction, rows=storage.rows, cols=storage.cols, rht=False, tile_scales=True,
            data=storage.data, scale_inv=tiles.view(torch.float8_e4m3fn), global_amax=storage.global_amax,
        )

    def _draw_keys(self, x, update_state):
        """The cast's stochastic-rounding keys (draw_keys), or None. Quantized zeros
        (update_state=False) draw no random numbers: the generator stays put."""
        if self.stochastic_rounding and update_state:
            return draw_keys(self._generator(x.device), x.device)
        return None

    def _quantize_2d(self, x, rowwise, columnwise, *, update_state=True):
        rows, cols = x.shape
        keys = self._draw_keys(x, update_state)
        kernel = lookup("nvfp4.cast", x)
        if kernel is not None:  # both directions from one read of each tile, after one read for the amaxes
            global_amax, column_amax = self._amaxes(x, columnwise)
            row, col = kernel(x, global_amax, column_amax, keys, rowwise, columnwise, self.block_2d, self.rht)
            return (self._storage("rowwise", x.shape, *row, global_amax) if rowwise else None, self._storage("columnwise", x.shape, *col, column_amax) if columnwise else None)
        return self._reference_cast(x, keys, rowwise, columnwise)

    def _reference_cast(self, x, keys, rowwise, columnwise):
        """(rowwise, columnwise) storages of the 2-D `x` by the pure-torch reference, rounding
        stochastically under `keys` (draw_keys) where given."""
        rows, cols = x.shape
        x = x.float()
        global_amax = tensor_amax(x)
        s_enc = encode_scale(global_amax)
        tiles = tile_amax(x) if self.block_2d else None
        rowwise_storage = columnwise_storage = None
        if rowwise:
            amax = tiles.repeat_interleave(BLOCK_SIZE, 0)[:rows] if self.block_2d else block_amax(x, BLOCK_SIZE)
            row_keys = None if keys is None else keys[:2]
            rowwise_storage = self._storage("rowwise", x.shape, *self._tiled(quantize_row_blocks(x, s_enc, amax, row_keys)), global_amax)
        if columnwise:
            x_t = x.t()
            column_amax, column_s_enc = global_amax, s_enc
            if self.rht:
                x_t = transformed_columns(x)
                column_amax = tensor_amax(x_t)
                column_s_enc = encode_scale(column_amax)
            if self.block_2d:
                amax = tiles.t().repeat_interleave(BLOCK_SIZE, 0)[:cols]
            else:
                amax = block_amax(x_t, BLOCK_SIZE)
            column_keys = None if keys is None else keys[2:]
            columnwise_storage = self._storage("columnwise", x.shape, *self._tiled(quantize_row_blocks(x_t, column_s_enc, amax, column_keys)), column_amax)
        return rowwise_storage, columnwise_storage

    def _tiled(self, cast):
        """(codes, block scales) of a cast, with one row of scales per 16x16 tile where it is in tiles."""
        codes, scales = cast
        return (codes, tile_rows(scales)) if self.block_2d else (codes, scales)

    # ---- grouped GEMMs: every group at once, each at its own tensor scale (formats/nvfp4_groups.py)
    def group_block_rows(self) -> int:
        return BLOCK_SIZE  # q · float(s) is exact in bf16; the tensor scale goes to the GEMM's epilogue

    def reduction_transform(self, direction):
        return "rht" if direction == "columnwise" and self.rht else None

    def quantize_padded_groups(self, x, groups, rowwise, columnwise, values=(False, False)):
        keys = None
        if self.stochastic_rounding:  # each group's own keys, from one draw
            keys = torch.randint(0, 2**32, (len(groups.lengths), 4), generator=self._generator(x.device), device=x.device, dtype=torch.int64)
        return cast_groups(self, x, groups, rowwise, columnwise, keys, values)

    def _amaxes(self, x, columnwise):
        """The global amax of `x` and that of the columnwise copy (of the transformed values with `rht`),
        each reduced over the shards' ranks inside `sharded_cast`."""
        if not (self.rht and columnwise):
            global_amax = tensor_amax(x)
            return global_amax, global_amax
        if amaxes_pre_reduced():  # both given, in tensor_amaxes' order: x is not read for them
            return tensor_amax(x), tensor_amax(x)
        plain, transformed = lookup("nvfp4.amaxes", x)(x)
        return reduce_amax(plain), reduce_amax(transformed)

    def tensor_amaxes(self, x, rowwise, columnwise):
        # The global amax (rowwise=False too: it scales a columnwise copy without the transform);
        # with the transform, the transformed values' amax after it.
        if not (self.rht and columnwise):
            return [finite_amax(x)]
        kernel = lookup("nvfp4.amaxes", x)
        if kernel is not None:
            return list(kernel(x))
        x = x.float()
        return [finite_amax(x), finite_amax(transformed_columns(x))]
