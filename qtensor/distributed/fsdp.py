"""FSDP2 all-gather extensions: every format gathers its low-precision bytes (docs/design.md, FSDP2).

A quantized layer weight (weights="quantized") and `DynamicWeight` (weights="dynamic", which
quantizes its local shard first) implement FSDP2's `fsdp_pre_all_gather` / `fsdp_post_all_gather`
(weight.py) through the two functions here, written once over the buffer contract:

- Each gather carries only the direction its GEMM reads: the forward gather the rowwise copy (plus
  what the backward reads when no re-gather follows, `reshard_after_forward=False`), the
  pre-backward re-gather the backward's direction. A direction the format rebuilds locally from
  another (Float8's transpose) is never sent.
- Each rank pads its shard to the padded shard's rows with zero codes and sends the per-row
  buffers as uint8 (gloo cannot carry float8). Tensor-wide buffers are not sent: the shards were
  quantized with one amax, reduced over the mesh, so every rank already holds them.
- With uneven shards FSDP2 needs every input to have the padded shard's shape: the bytes are then
  packed into one tensor of that shape and the smallest integer dtype that holds them.
- The gathered pieces are cut back to each rank's real rows and concatenated along each buffer's
  declared row axis; later gathers write into the unsharded tensor's buffers in place.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from ..core.numerics import all_reduce_max, ceil_div, sharded_cast
from ..core.ops import mark_scales, scales_agreed
from ..core.quantizer import autocast_off
from .fsdp_state import placement_groups
from .packing import aligned as _aligned, payload as _payload, row_buffers as _row_buffers, unpacked_rows
from ..core.storage import DIRECTIONS, Storage
from ..core.tensor import QuantizedTensor, rows_per_index, split_rebuilt as _split_rebuilt

# A diagnostic counter for the whole process, written under a lock: bytes this process handed to
# FSDP2 all-gathers of qtensor weights, and what bf16 would have sent.
_STATS = {"all_gathers": 0, "bytes": 0, "bf16_bytes": 0}
_STATS_LOCK = threading.Lock()


def gather_stats(reset: bool = False) -> dict[str, int]:
    """{"all_gathers", "bytes", "bf16_bytes"} handed to all-gathers by this process since the last
    reset: what qtensor weights sent, and what the same shards would have sent in bf16."""
    with _STATS_LOCK:
        stats = dict(_STATS)
        if reset:
            _STATS.update(all_gathers=0, bytes=0, bf16_bytes=0)
    return stats


def count_gather(inputs, mesh, outer_size) -> None:
    with _STATS_LOCK:
        _STATS["all_gathers"] += 1
        _STATS["bytes"] += sum(t.numel() * t.element_size() for t in inputs)
        _STATS["bf16_bytes"] += 2 * ceil_div(outer_size[0], mesh.size()) * math.prod(outer_size[1:])


@dataclass(frozen=True)
class GatherPlan:
    """What one all-gather carries and how to rebuild the unsharded tensor from it."""

    directions: tuple[str, ...]  # the directions whose bytes are sent
    rebuilt: tuple[str, ...]  # directions made locally from a sent one after the gather
    shard_rows: int  # rows of the padded shard's 2-D view
    packed: bool  # uneven shards: the input has the padded shard's shape
    world_size: int
    # Each sent buffer is an all-gather input of its own and arrives as the unsharded buffer, used
    # in place (no copy in or out): even shards whose buffers join end to end (`_in_place_sizes`).
    in_place: bool = False
    # The forward's gather sends one direction and the re-gather before the backward the other,
    # neither rebuilt locally: the unsharded tensor's two directions share one buffer
    # (`_sharing_one_buffer`), holding whichever the last gather brought.
    alternating: bool = False


def directions_needed(linear_quantizers, regather: bool | None) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """The directions the GEMMs of this phase read, and every set a gather of this parameter may
    need (FSDP2 sizes its all-gather buffers once: each gather sends the same number of bytes).
    `regather` None (unknown) is taken as False: the forward brings what the backward reads too."""
    override = linear_quantizers.backward_override if linear_quantizers is not None else None
    # high_precision saves the forward's dequantized weight; dequantized saves the rowwise copy.
    backward = "columnwise" if override is None else "rowwise"
    both = tuple(dict.fromkeys(("rowwise", backward)))
    phases = (("rowwise",), (backward,)) if regather else (("rowwise",), both)
    if torch._C._current_graph_task_id() != -1:  # the pre-backward re-gather runs inside backward
        return (backward,), phases
    # FSDP2 gathers under no_grad whatever the forward does: without a re-gather the forward's
    # gather must bring what a backward would read.
    return (("rowwise",) if regather else both), phases


def directions_held(needed, tensor: QuantizedTensor):
    """`needed` (`directions_needed`) for a tensor that holds only some directions (a frozen weight
    keeping the forward's copy): a direction it lacks is rebuilt where the backward reads it
    (`Quantizer.rebuild_direction`), from the copy it holds, which is gathered instead."""
    held = tuple(d for d in DIRECTIONS if getattr(tensor, d) is not None)

    def fit(directions):
        return tuple(dict.fromkeys(d if d in held else held[0] for d in directions))

    directions, phases = needed
    return fit(directions), tuple(fit(phase) for phase in phases)


def check_block_boundaries(tensor: QuantizedTensor, directions, shard_rows: int, name: str) -> None:
    """A shard edge must fall on a block boundary of every direction that is gathered (docs/design.md, FSDP2)."""
    for direction in directions:
        storage = tensor.storage_for(direction)
        block = storage.row_block()
        if shard_rows % block:
            raise ValueError(
                f"{name}: FSDP2 shards its {tensor.shape[0]} rows into pieces of {shard_rows} "
                f"(2-D view rows), which cuts the {block}-row blocks of its {storage.format_name} "
                f"{direction} copy. Use a row count that divides into multiples of {block} per rank, "
                f"shard over fewer ranks, or keep this layer out of quantize_ with filter_fn."
            )


def agree_on_scales(tensor: QuantizedTensor, groups) -> None:
    """Make every rank's shard use one tensor-wide scale. A shard written without the mesh's amax
    (initialised after `to_empty`, loaded from plain values) may hold its own; then every rank
    requantizes its shard from its exact values with the amax reduced over `groups` (`shard_groups`)."""
    if scales_agreed(tensor):
        return
    values = [
        getattr(storage, spec.name).float().reshape(-1)
        for storage in (tensor.rowwise, tensor.columnwise)
        if storage is not None
        for spec in storage.buffer_specs()
        if spec.tensor_wide
    ]
    if values:
        high = torch.cat(values)
        low = -high
        all_reduce_max(high, groups)
        all_reduce_max(low, groups)
        if not torch.equal(high, -low):  # the same answer on every rank: all requantize or none
            with sharded_cast(groups), torch.no_grad():
                tensor.copy_(tensor.dequantize())
    mark_scales(tensor, True)


def without_autocast(function):
    """FSDP2 runs the hooks inside the module's forward, under the caller's autocast, which would
    promote the buffers torch.cat joins (and knows no float8): the gather works on bytes."""

    def wrapped(tensor, *args, **kwargs):
        if tensor.device.type == "meta":
            return function(tensor, *args, **kwargs)
        with autocast_off(tensor.device.type):
            return function(tensor, *args, **kwargs)

    return wrapped


@without_autocast
def pre_all_gather(tensor: QuantizedTensor, mesh, outer_size: torch.Size, needed, name: str):
    """The all-gather input (the needed directions' bytes, as one uint8 payload) and the plan."""
    directions, phases = needed
    world_size = mesh.size()
    shard_rows = ceil_div(outer_size[0], world_size) * _rows_per_index(outer_size)
    rebuilt, sent = _split_rebuilt(tensor, directions)
    splits = [_split_rebuilt(tensor, phase) for phase in phases]  # (rebuilt, sent) of every phase
    if world_size > 1:  # one rank's shard is the whole tensor: no edge to cut a block
        check_block_boundaries(tensor, {d for _, phase_sent in splits for d in phase_sent}, shard_rows, name)
    pieces = [b for d in sent for b in _row_buffers(tensor.storage_for(d).zero_padded(shard_rows))]
    alternating = len(splits) == 2 and all(not r and len(s) == 1 for r, s in splits) and splits[0][1] != splits[1][1]
    packed = outer_size[0] % world_size != 0
    sizes = None if packed else _in_place_sizes(tensor, {phase_sent for _, phase_sent in splits}, shard_rows)
    # On one rank FSDP2 (torch 2.11 to 2.13) copies only the first all-gather input into its output.
    one_input_only = world_size == 1 and len(pieces) > 1
    if sizes == [b.nbytes for b in pieces] and all(b.is_contiguous() for b in pieces) and not one_input_only:
        # Each buffer is an all-gather input of its own: FSDP2 copies it into its all-gather buffer,
        # and what arrives for it is the unsharded buffer (post_all_gather uses it in place).
        inputs = tuple(b.reshape(-1).view(torch.uint8) for b in pieces)
        count_gather(inputs, mesh, outer_size)
        return inputs, GatherPlan(sent, rebuilt, shard_rows, packed, world_size, in_place=True)
    # Every gather of this parameter sends the same number of bytes: the most any phase sends.
    capacity = max(_payload_bytes(tensor, phase_sent, shard_rows) for _, phase_sent in splits)
    # Uneven shards: FSDP2 wants the input in the padded shard's shape.
    padded_shape = (ceil_div(outer_size[0], world_size), *outer_size[1:]) if packed else None
    packed_input = _payload(pieces, [_aligned(b.nbytes) for b in pieces], capacity, tensor.device, padded_shape)
    count_gather((packed_input,), mesh, outer_size)
    return (packed_input,), GatherPlan(sent, rebuilt, shard_rows, packed, world_size, alternating=alternating)


@without_autocast
def post_all_gather(
    local: QuantizedTensor, outputs, plan: GatherPlan, outer_size: torch.Size, dtype: torch.dtype, out=None
):
    """The unsharded tensor (first call: `(tensor, inner_tensors)`), or `out` updated in place."""
    total_rows = outer_size[0] * _rows_per_index(outer_size)
    gathered = (_arrived_in_place if plan.in_place else _unpacked)(local, outputs, plan, total_rows)
    if out is not None:
        # Over a tensor-parallel DTensor, FSDP2's unsharded parameter is a DTensor of the gathered tensor.
        out = getattr(out, "_local_tensor", out)
        _write_into(out, gathered)
        for direction in plan.rebuilt:  # made from the rowwise copy just written, in one pass
            if getattr(out, direction) is not out.rowwise:
                out.rowwise.write_direction_into(getattr(out, direction))
        return None
    for direction in plan.rebuilt:
        shared = local.columnwise is local.rowwise
        gathered[direction] = gathered["rowwise"] if shared else gathered["rowwise"].to_direction(direction)
    # The unsharded tensor owns all its buffers: FSDP2 frees them between uses, and the tensor-wide
    # ones must not be the local shard's (one copy, shared by both directions as in the shard).
    copies: dict[int, torch.Tensor] = {}
    for direction, storage in gathered.items():
        for spec in storage.buffer_specs():
            if spec.tensor_wide:
                buffer = getattr(storage, spec.name)
                setattr(storage, spec.name, copies.setdefault(id(buffer), buffer.clone()))
    storages, shared = {}, None
    if plan.alternating and all(getattr(local, d) is not None for d in DIRECTIONS):
        storages, shared = _sharing_one_buffer(local, gathered, total_rows, copies)
    for direction in DIRECTIONS:
        present = getattr(local, direction)
        if direction in storages:
            continue
        if direction in gathered:
            storages[direction] = gathered[direction]
        elif present is not None:
            # Not read in this phase: allocated here, filled in place by the gather that needs it.
            storages[direction] = _empty_like_rows(present, total_rows, copies)
        else:
            storages[direction] = None
    unsharded = local.with_storages(storages["rowwise"], storages["columnwise"], shape=torch.Size(outer_size), dtype=dtype)
    # FSDP2 frees and refills its own outputs and the inner tensors returned here, each by resizing
    # its storage to the tensor's size: a view of an output (a gather used in place) or of the
    # shared buffer is left out (resizing for a view would cut that storage), the shared buffer is in.
    left_out = {output.untyped_storage().data_ptr() for output in outputs}
    if shared is not None:
        left_out.add(shared.untyped_storage().data_ptr())
    buffers = unsharded.buffer_dict(quantizer_state=False).values()
    inner = tuple(b for b in buffers if b.untyped_storage().data_ptr() not in left_out)
    return unsharded, inner + ((shared,) if shared is not None else ())


def _unpacked(local: QuantizedTensor, outputs, plan: GatherPlan, total_rows: int) -> dict[str, Storage]:
    """Each sent direction's unsharded storage from the one packed output: every rank's piece cut
    back to its real rows, the pieces joined."""
    (output,) = outputs
    raw = output.reshape(-1).view(torch.uint8)
    per_rank = raw.numel() // plan.world_size
    templates = {d: local.storage_for(d) for d in plan.directions}
    pieces: dict[str, list[Storage]] = {d: [] for d in plan.directions}
    for rank in range(plan.world_size):
        rows = max(0, min(plan.shard_rows, total_rows - rank * plan.shard_rows))
        offset = rank * per_rank
        for direction, template in templates.items():
            piece, offset = unpacked_rows(raw, template, plan.shard_rows, offset)
            if rows:
                pieces[direction].append(piece.slice_rows(0, rows))
    return {d: type(templates[d]).cat_rows(pieces[d]) for d in plan.directions}


def _arrived_in_place(local: QuantizedTensor, outputs, plan: GatherPlan, total_rows: int) -> dict[str, Storage]:
    """Each sent direction's unsharded storage over the outputs as they arrived (`GatherPlan.in_place`:
    one output per buffer, each the whole buffer): views of FSDP2's all-gather outputs, which FSDP2
    frees after the layer's GEMMs and fills again, in the same storage, at the next gather."""
    arrived = iter(output.reshape(-1).view(torch.uint8) for output in outputs)
    gathered = {}
    for direction in plan.directions:
        template = local.storage_for(direction)
        buffers = {
            spec.name: getattr(template, spec.name) if spec.tensor_wide else next(arrived).view(spec.dtype).reshape(spec.shape)
            for spec in template.layout(template.direction, total_rows, template.cols, **template.options)
        }
        gathered[direction] = template.rebuilt(buffers, rows=total_rows)
    return gathered


def full_tensor(value: torch.Tensor, name: str) -> torch.Tensor:
    """The whole tensor behind a sharded (DTensor) state_dict entry, on every rank: a quantized one
    gathered as its low-precision bytes (every direction it holds), anything else by DTensor."""
    local = getattr(value, "_local_tensor", None)
    if not isinstance(local, QuantizedTensor):
        return value.full_tensor() if local is not None else value
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    if tuple(value.placements) != (Shard(0),):
        return _assembled(value, local, name)
    mesh, outer_size = value.device_mesh, value.shape
    directions = tuple(d for d in DIRECTIONS if getattr(local, d) is not None)
    inputs, plan = pre_all_gather(local, mesh, outer_size, (directions, (directions,)), name)
    outputs = []
    for payload in inputs:  # one payload, or one per buffer where they arrive as the whole buffers
        payload = payload.reshape(-1).view(torch.uint8)
        outputs.append(payload.new_empty(payload.numel() * mesh.size()))
        dist.all_gather_into_tensor(outputs[-1], payload, group=mesh.get_group())
    whole, _ = post_all_gather(local, tuple(outputs), plan, outer_size, local.dtype)
    return whole


def _assembled(value, local: QuantizedTensor, name: str) -> QuantizedTensor:
    """A quantized DTensor split along rows and/or columns (tensor parallelism, FSDP2 over it): every
    rank's piece, with its offset in the whole tensor, gathered over each mesh dimension that splits
    it, then joined along columns within each band of rows and the bands along rows."""
    import torch.distributed as dist
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if value.dim() != 2 or any(p.is_partial() for p in value.placements):
        raise ValueError(
            f"{name}: gathering a quantized tensor placed {value.placements} is supported for 2-D tensors split "
            "along rows or columns (FSDP2, tensor parallelism), not for this placement."
        )
    mesh = value.device_mesh
    _, offset = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
    pieces = [(tuple(offset), local)]
    for group in placement_groups(mesh, value.placements):
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, pieces, group=group)
        pieces = [piece for part in gathered for piece in part]
    # Unpickled where the sender held them (another GPU under NCCL): each brought to this rank's device.
    pieces = sorted(((where, piece.to(local.device)) for where, piece in pieces), key=lambda item: item[0])
    storages = {}
    for direction in DIRECTIONS:
        if getattr(local, direction) is None or (direction == "columnwise" and local.columnwise is local.rowwise):
            continue
        bands = {}
        for (row, _), piece in pieces:
            bands.setdefault(row, []).append(getattr(piece, direction))
        kind = type(getattr(local, direction))
        storages[direction] = kind.cat_rows([kind.cat_cols(band) for band in bands.values()])
    rowwise = storages.get("rowwise")
    columnwise = rowwise if local.columnwise is not None and local.columnwise is local.rowwise else storages.get("columnwise")
    return local.with_storages(rowwise, columnwise, shape=value.shape, dtype=local.dtype)


# ---- helpers -------------------------------------------------------------------------------------
def _rows_per_index(shape) -> int:
    return rows_per_index(shape) if len(shape) > 1 else 1


def _in_place_sizes(tensor: QuantizedTensor, sent: set, shard_rows: int) -> list[int] | None:
    """The bytes of each buffer a gather of `tensor` sends, where every phase sends the same
    directions (`sent`: the set of what each phase sends; FSDP2 sizes its outputs once, and a buffer
    used in place holds what every gather brings: a forward recomputed inside the backward, under
    activation checkpointing, reads the forward's direction) and their shards join end to end into
    the unsharded buffers (each follows the rows along its first axis, unpadded); else None."""
    if len(sent) != 1:
        return None
    sizes = []
    for direction in next(iter(sent)):
        storage = tensor.storage_for(direction)
        for spec in storage.layout(storage.direction, shard_rows, storage.cols, **storage.options):
            if spec.tensor_wide:
                continue
            if spec.row_axis != 0 or spec.rows_padded_to > 1:
                return None
            sizes.append(math.prod(spec.shape) * spec.dtype.itemsize)
    return sizes


def _payload_bytes(tensor: QuantizedTensor, sent, shard_rows: int) -> int:
    total = 0
    for direction in sent:
        storage = tensor.storage_for(direction)
        for spec in storage.layout(storage.direction, shard_rows, storage.cols, **storage.options):
            if not spec.tensor_wide:
                total += _aligned(math.prod(spec.shape) * spec.dtype.itemsize)
    return total


def _empty_like_rows(storage: Storage, rows: int, copies: dict) -> Storage:
    buffers = {}
    for spec in storage.layout(storage.direction, rows, storage.cols, **storage.options):
        if spec.tensor_wide:
            buffer = getattr(storage, spec.name)
            buffers[spec.name] = copies.setdefault(id(buffer), buffer.clone())
        else:
            # Poisoned until the gather that needs it fills it: 0xFF bytes are NaN in every
            # format's scale or element codes, so a read before then shows, never passes silently.
            poisoned = torch.empty(spec.shape, dtype=spec.dtype, device=storage.device)
            poisoned.reshape(-1).view(torch.uint8).fill_(0xFF)
            buffers[spec.name] = poisoned
    return storage.rebuilt(buffers, rows=rows)


def _sharing_one_buffer(local: QuantizedTensor, gathered: dict[str, Storage], rows: int, copies: dict) -> tuple[dict, torch.Tensor]:
    """({direction: unsharded storage}, the byte buffer under both): each direction's per-block
    buffers laid out from the start of one buffer as large as the larger direction's, the gathered
    direction's bytes copied in. A gather that sends one direction fills it; the other direction's
    bytes are then stale (a forward recomputed after a backward's re-gather is refused:
    `QuantizedWeight.linear_operand`). Tensor-wide buffers stay separate, one copy each."""
    layouts = {}
    for direction in DIRECTIONS:
        storage = local.storage_for(direction)
        layouts[direction] = storage.layout(storage.direction, rows, storage.cols, **storage.options)
    size = max(_payload_bytes(local, (direction,), rows) for direction in DIRECTIONS)
    shared = torch.empty(size, dtype=torch.uint8, device=local.device)
    storages = {}
    for direction, specs in layouts.items():
        source = gathered[direction] if direction in gathered else local.storage_for(direction)
        buffers, offset = {}, 0
        for spec in specs:
            if spec.tensor_wide:
                buffer = getattr(source, spec.name)
                buffers[spec.name] = buffer if direction in gathered else copies.setdefault(id(buffer), buffer.clone())
                continue
            nbytes = math.prod(spec.shape) * spec.dtype.itemsize
            buffers[spec.name] = shared[offset : offset + nbytes].view(spec.dtype).reshape(spec.shape)
            offset += _aligned(nbytes)
        storages[direction] = local.storage_for(direction).rebuilt(buffers, rows=rows)
    for direction, storage in gathered.items():
        for name, buffer in storages[direction].buffers.items():
            if buffer.data_ptr() != storage.buffers[name].data_ptr():
                buffer.copy_(storage.buffers[name])
    return storages, shared


def _write_into(out: QuantizedTensor, gathered: dict[str, Storage]) -> None:
    done = set()
    for direction, storage in gathered.items():
        mine = getattr(out, direction)
        for name, target in mine.buffers.items():
            # (A buffer used in place is already the view of the output the first gather made.)
            if id(target) not in done and target.data_ptr() != storage.buffers[name].data_ptr():
                done.add(id(target))
                # The same values gathered again: autograd's saved copies of these buffers (compiled
                # graphs save them) stay valid, as FSDP2 keeps them for its own unsharded tensors.
                with torch.autograd._unsafe_preserve_version_counter(target):
                    target.copy_(storage.buffers[name])
