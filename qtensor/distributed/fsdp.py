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

from ..core.numerics import all_reduce_max, ceil_div, reduce_amax_over
from ..core.ops import mark_scales, scales_agreed
from .packing import aligned as _aligned, row_buffers as _row_buffers, unpacked_rows
from ..core.storage import DIRECTIONS, Storage
from ..core.tensor import QuantizedTensor, rows_per_index, split_rebuilt as _split_rebuilt

_PACK_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)

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


def regathers_before_backward(running, module) -> bool | None:
    """Whether FSDP2 gathers this layer's weight again before backward (`reshard_after_forward`).

    Read from the FSDP2 state of the module FSDP2 passes to the hook (the module owning the
    parameter) or of the `fully_shard`-ed module above it, found once under the model
    `quantize_` was given (`running.root`). None where that cannot be read (a torch whose FSDP2
    state looks different, a model sharded above the module quantize_ was given): the forward
    gather then also brings what the backward reads, which is correct and sends more bytes."""
    try:
        return bool(layer_param_group(running, module)._reshard_after_forward)
    except AttributeError:
        return None


def layer_param_group(running, module):
    """The FSDP2 parameter group holding the parameters of `module` (the module FSDP2 passes to the
    hooks), found once under `running.root` and kept in `running.fsdp_group`; None if not found."""
    group = running.fsdp_group
    if group is None:
        # False: looked for and not found (not looked for again).
        group = running.fsdp_group = _param_group_of(module, running.root() if running.root is not None else None) or False
    return group or None


def _param_group_of(module, root):
    """The FSDP2 parameter group that holds `module`'s parameters, or None."""
    candidates = [module] + ([] if root is None else list(root.modules()))
    for candidate in candidates:
        get_state = getattr(candidate, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            group = get_state()._fsdp_param_group
            owners = [param._module_info.module for param in group.fsdp_params]
        except (AttributeError, AssertionError):
            continue
        if any(owner is module for owner in owners):
            return group
    return None


@dataclass(frozen=True)
class ShardedParameter:
    """One parameter FSDP2 shards, as its hooks see it: the local shard they are called on, the
    process groups its pieces are spread over (`shard_groups`) and the dtype its values are gathered
    in (None: its own)."""

    local: torch.Tensor
    groups: tuple
    param_dtype: torch.dtype | None


def shard_groups(fsdp_param) -> tuple:
    """The process groups over whose ranks one FSDP2 parameter's pieces are spread: FSDP2's own, then
    each mesh dimension along which its DTensor was sharded before `fully_shard` (tensor parallelism
    on a 2-D mesh). A tensor-wide amax max-ed over all of them is the whole parameter's."""
    groups = (fsdp_param.shard_mesh_from_root.get_group(),)
    spec = getattr(fsdp_param, "_unsharded_dtensor_spec", None)
    return groups + (placement_groups(spec.mesh, spec.placements) if spec is not None else ())


def placement_groups(mesh, placements) -> tuple:
    """The process groups of the mesh dimensions along which a DTensor with `placements` is split
    (`Shard`, and the `_StridedShard` FSDP2 places over a tensor-parallel shard of the same dim)."""
    return tuple(mesh.get_group(dim) for dim, p in enumerate(placements) if not (p.is_replicate() or p.is_partial()))


def groups_of_shard(local: torch.Tensor, mesh, running, module) -> tuple:
    """`shard_groups` of the parameter whose FSDP2 shard is `local` (the tensor FSDP2's hooks are
    called on), kept in `running.shard_groups`; FSDP2's mesh alone where its state cannot be read
    (a tensor-parallel layer then refuses to run, tensor_parallel.py)."""
    group = mesh.get_group()
    if running.shard_groups is None or running.shard_groups[0] is not group:
        found = layer_param_group(running, module)
        params = [p for p in (found.fsdp_params if found is not None else ()) if p._sharded_local_tensor is local]
        running.shard_groups = shard_groups(params[0]) if params else (group,)
    return running.shard_groups


def sharded_parameters(groups) -> list[ShardedParameter]:
    """Every parameter of FSDP2's parameter `groups`, in their order (the same on every rank).
    Parameters it offloads to the CPU are left out: their hooks run on a copy made for each gather."""
    found = []
    for group in groups:
        try:
            for param in group.fsdp_params:
                if not param.offload_to_cpu:
                    found.append(ShardedParameter(param._sharded_local_tensor, shard_groups(param), param.mp_policy.param_dtype))
        except AttributeError:
            continue
    return found


def param_groups(root):
    """FSDP2's parameter groups under the module `root`, in the order of `root.modules()` (the same
    on every rank); none where FSDP2's state cannot be read."""
    for module in root.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            state = get_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            groups = [g for g in (groups if groups is not None else [state._fsdp_param_group]) if g is not None]
        except (AttributeError, AssertionError):
            continue
        yield from groups


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
    import torch.distributed as dist

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
            with reduce_amax_over(groups), torch.no_grad():
                tensor.copy_(tensor.dequantize())
    mark_scales(tensor, True)


def without_autocast(function):
    """FSDP2 runs the hooks inside the module's forward, under the caller's autocast, which would
    promote the buffers torch.cat joins (and knows no float8): the gather works on bytes."""

    def wrapped(tensor, *args, **kwargs):
        if tensor.device.type == "meta":
            return function(tensor, *args, **kwargs)
        with torch.autocast(tensor.device.type, enabled=False):
            return function(tensor, *args, **kwargs)

    return wrapped


@without_autocast
def pre_all_gather(tensor: QuantizedTensor, mesh, outer_size: torch.Size, needed, name: str):
    """The all-gather input (the needed directions' bytes, as one uint8 payload) and the plan."""
    directions, phases = needed
    world_size = mesh.size()
    shard_rows = ceil_div(outer_size[0], world_size) * _rows_per_index(outer_size)
    rebuilt, sent = _split_rebuilt(tensor, directions)
    check_block_boundaries(tensor, {d for phase in phases for d in _split_rebuilt(tensor, phase)[1]}, shard_rows, name)
    pieces = [b for d in sent for b in _row_buffers(tensor.storage_for(d).zero_padded(shard_rows))]
    # Every gather of this parameter sends the same number of bytes: the most any phase sends.
    capacity = max(_payload_bytes(tensor, _split_rebuilt(tensor, phase)[1], shard_rows) for phase in phases)
    packed = outer_size[0] % world_size != 0
    if packed:  # uneven shards: FSDP2 wants the input in the padded shard's shape
        padded_shape = (ceil_div(outer_size[0], world_size), *outer_size[1:])
        dtype = next(d for d in _PACK_DTYPES if math.prod(padded_shape) * d.itemsize >= capacity)
        payload = torch.zeros(padded_shape, dtype=dtype, device=tensor.device)
    else:
        payload = torch.zeros(capacity, dtype=torch.uint8, device=tensor.device)
    raw, offset = payload.view(-1).view(torch.uint8), 0
    for buffer in pieces:
        raw[offset : offset + buffer.nbytes].copy_(buffer.reshape(-1).view(torch.uint8))
        offset += _aligned(buffer.nbytes)
    count_gather((payload,), mesh, outer_size)
    return (payload,), GatherPlan(sent, rebuilt, shard_rows, packed, world_size)


@without_autocast
def post_all_gather(
    local: QuantizedTensor, outputs, plan: GatherPlan, outer_size: torch.Size, dtype: torch.dtype, out=None
):
    """The unsharded tensor (first call: `(tensor, inner_tensors)`), or `out` updated in place."""
    total_rows = outer_size[0] * _rows_per_index(outer_size)
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
    gathered = {d: type(templates[d]).cat_rows(pieces[d]) for d in plan.directions}
    for direction in plan.rebuilt:
        shared = local.columnwise is local.rowwise
        gathered[direction] = gathered["rowwise"] if shared else gathered["rowwise"].to_direction(direction)
    if out is not None:
        # Over a tensor-parallel DTensor, FSDP2's unsharded parameter is a DTensor of the gathered tensor.
        _write_into(getattr(out, "_local_tensor", out), gathered)
        return None
    # The unsharded tensor owns all its buffers: FSDP2 frees them between uses, and the tensor-wide
    # ones must not be the local shard's (one copy, shared by both directions as in the shard).
    copies: dict[int, torch.Tensor] = {}
    for direction, storage in gathered.items():
        for spec in storage.buffer_specs():
            if spec.tensor_wide:
                buffer = getattr(storage, spec.name)
                setattr(storage, spec.name, copies.setdefault(id(buffer), buffer.clone()))
    storages = {}
    for direction in DIRECTIONS:
        present = getattr(local, direction)
        if direction in gathered:
            storages[direction] = gathered[direction]
        elif present is not None:
            # Not read in this phase: allocated here, filled in place by the gather that needs it.
            storages[direction] = _empty_like_rows(present, total_rows, copies)
        else:
            storages[direction] = None
    unsharded = local.with_storages(storages["rowwise"], storages["columnwise"], shape=torch.Size(outer_size), dtype=dtype)
    buffers = unsharded.buffer_dict(quantizer_state=False)
    return unsharded, tuple(buffers.values())


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
    (payload,), plan = pre_all_gather(local, mesh, outer_size, (directions, (directions,)), name)
    payload = payload.reshape(-1).view(torch.uint8)
    output = payload.new_empty(payload.numel() * mesh.size())
    dist.all_gather_into_tensor(output, payload, group=mesh.get_group())
    whole, _ = post_all_gather(local, (output,), plan, outer_size, local.dtype)
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


def _write_into(out: QuantizedTensor, gathered: dict[str, Storage]) -> None:
    done = set()
    for direction, storage in gathered.items():
        mine = getattr(out, direction)
        for name, target in mine.buffers.items():
            if id(target) not in done:
                done.add(id(target))
                # The same values gathered again: autograd's saved copies of these buffers (compiled
                # graphs save them) stay valid, as FSDP2 keeps them for its own unsharded tensors.
                with torch.autograd._unsafe_preserve_version_counter(target):
                    target.copy_(storage.buffers[name])
