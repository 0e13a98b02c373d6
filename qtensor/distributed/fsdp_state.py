"""Every read of FSDP2's private state, in one place, each with its fallback.

FSDP2 (`fully_shard`) passes its hooks the module that owns the parameter and the mesh, which is all
its public API gives. Three things qtensor needs are only in its private state:

- whether the layer's weight is gathered again before backward (`_reshard_after_forward` of the
  parameter group): the forward gather then brings only the rowwise copy. Fallback: unknown is taken
  as "no re-gather", so the forward gather brings what the backward reads too (correct, more bytes;
  pinned by tests/test_fsdp.py);
- which process groups one parameter's pieces are spread over (FSDP2's mesh plus a tensor-parallel
  mesh dimension on a 2-D mesh: `shard_mesh_from_root`, `_unsharded_dtensor_spec`, matched to the
  hook's tensor by `_sharded_local_tensor`). Fallback: FSDP2's mesh alone (a tensor-parallel layer
  then refuses to run, naming itself);
- every parameter of the model's parameter groups (`_get_fsdp_state`, `_fsdp_param_group(s)`,
  `fsdp_params`), to reduce every stale dynamic weight's amaxes in one collective. Fallback: each
  cast reduces its own amaxes (the same values, one collective each).

Each read is written to fail with AttributeError or AssertionError on a torch whose state looks
different, and each caller takes the fallback then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
