"""Every read of FSDP2's private state, in one place, each with its fallback.

FSDP2 (`fully_shard`) passes its hooks the module that owns the parameter and the mesh, which is all
its public API gives. Three things qtensor needs are only in its private state:

- whether the layer's weight is gathered again before backward (`_reshard_after_forward` of the
  parameter group): the forward gather then brings only the rowwise copy. Fallback: unknown is taken
  as "no re-gather", so the forward gather brings what the backward reads too (correct, more bytes;
  pinned by tests/test_fsdp.py);
- which process groups one parameter's pieces are spread over (FSDP2's mesh plus a tensor-parallel
  mesh dimension on a 2-D mesh: `shard_mesh_from_root`, `_unsharded_dtensor_spec` (torch 2.11:
  `_tp_spec`), matched to the hook's tensor by `_sharded_local_tensor`). Fallback: FSDP2's mesh
  alone (a tensor-parallel layer then refuses to run, naming itself);
- FSDP2's states (torch's table of composable-API states, `_composable_state._module_state_mapping`;
  a model's states, `_state_ctx.all_states`) and in them every parameter group
  (`_fsdp_param_group(s)`, `fsdp_params`): to find the group that holds a layer's weight (for the two
  reads above), and to reduce the amaxes of a model's stale dynamic weight shards in one collective.
  Fallback: each cast reduces its own amaxes (the same values, one collective each), and the two
  reads above take theirs.

Each read is written to fail with AttributeError or AssertionError on a torch whose state looks
different, and each caller takes the fallback then.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FsdpLayer:
    """What FSDP2's hooks tell a layer about how its weight is sharded, noted by the weight's first
    hook (`layer_sharding`) and kept in the layer's `LayerRunning.fsdp`:

    - `mesh_group`: FSDP2's process group, which reduces the layer's delayed-scaling amaxes unless
      the user chose a group;
    - `shard_groups`: every group the weight's pieces are spread over (`shard_groups`), over which its
      casts reduce their tensor-wide amaxes;
    - `param_group`: FSDP2's parameter group holding the weight, and `model_groups` every parameter
      group of the model it belongs to (the tree under one `fully_shard` root, in the same order on
      every rank); None and () where FSDP2's state could not be read.

    The parameter groups are held by weak reference: FSDP2's state holds the parameters, whose
    quantizers hold this, and a strong reference back would make a cycle that runs through
    autograd's references between a parameter and its shards, which the garbage collector cannot
    see, so a deleted model would keep its parameters."""

    mesh_group: object
    shard_groups: tuple
    _param_group: weakref.ref | None
    _model_groups: tuple = ()

    @classmethod
    def of(cls, mesh_group, shard_groups: tuple, param_group, model_groups: tuple) -> "FsdpLayer":
        return cls(mesh_group, shard_groups, None if param_group is None else weakref.ref(param_group), tuple(weakref.ref(g) for g in model_groups))

    @property
    def param_group(self):
        return None if self._param_group is None else self._param_group()

    @property
    def model_groups(self) -> tuple:
        return tuple(group for group in (reference() for reference in self._model_groups) if group is not None)


def layer_sharding(running, local: torch.Tensor, mesh, module) -> FsdpLayer:
    """The `FsdpLayer` of the layer whose weight's FSDP2 shard is `local` (the tensor FSDP2's hooks
    are called on, with `mesh` and the `module` owning the parameter), found once and kept in
    `running.fsdp`. Where FSDP2's state cannot be read, its mesh alone holds the pieces (a
    tensor-parallel layer then refuses to run, tensor_parallel.py)."""
    group = mesh.get_group()
    known = running.fsdp
    if known is None or known.mesh_group is not group:
        param_group, model_groups = _param_group_of(module)
        param = _fsdp_param_of(local, param_group)
        groups = shard_groups(param) if param is not None else (group,)
        known = running.fsdp = FsdpLayer.of(group, groups, param_group, model_groups)
    return known


def regathers_before_backward(fsdp: FsdpLayer) -> bool | None:
    """Whether FSDP2 gathers this layer's weight again before backward (`reshard_after_forward` of
    its parameter group). None where that cannot be read (a torch whose FSDP2 state looks different):
    the forward gather then also brings what the backward reads, which is correct and sends more bytes."""
    try:
        return bool(fsdp.param_group._reshard_after_forward)
    except AttributeError:
        return None


def _fsdp_states():
    """Every FSDP2 state of this process, one for each `fully_shard` call: FSDP2 registers each with
    torch's table of composable-API states. Models no longer used may still be listed (until the
    garbage collector, which runs at its own time on each rank, frees them)."""
    try:
        from torch.distributed import _composable_state

        references = list(_composable_state._module_state_mapping.values())
    except (ImportError, AttributeError):
        return
    seen = set()
    for reference in references:
        state = reference()
        # `_fsdp_param_groups` first: the singular is a property that raises with several groups (torch 2.13).
        fsdp = state is not None and (hasattr(state, "_fsdp_param_groups") or hasattr(state, "_fsdp_param_group"))
        if fsdp and id(state) not in seen:
            seen.add(id(state))
            yield state


def _param_group_of(module) -> tuple:
    """(the FSDP2 parameter group that holds `module`'s parameters, every parameter group of its
    model), or (None, ()). A model's groups are those of the states its root's lazy initialisation
    lists (`_state_ctx.all_states`, in the order of the root's modules, the same on every rank),
    which every state of the tree shares."""
    for state in _fsdp_states():
        for group in param_groups([state]):
            try:
                owners = [param._module_info.module for param in group.fsdp_params]
            except AttributeError:
                continue
            if any(owner is module for owner in owners):
                try:
                    return group, tuple(param_groups(state._state_ctx.all_states))
                except AttributeError:
                    return group, ()
    return None, ()


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
    # The DTensor spec of the parameter before fully_shard: `_unsharded_dtensor_spec` in torch 2.13,
    # `_tp_spec` in torch 2.11 (absent where the parameter was no DTensor).
    spec = getattr(fsdp_param, "_unsharded_dtensor_spec", None) or getattr(fsdp_param, "_tp_spec", None)
    return groups + (placement_groups(spec.mesh, spec.placements) if spec is not None else ())


def placement_groups(mesh, placements) -> tuple:
    """The process groups of the mesh dimensions along which a DTensor with `placements` is split
    (`Shard`, and the `_StridedShard` FSDP2 places over a tensor-parallel shard of the same dim)."""
    return tuple(mesh.get_group(dim) for dim, p in enumerate(placements) if not (p.is_replicate() or p.is_partial()))


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


def trains(local, group) -> bool | None:
    """Whether the parameter whose local shard is `local` requires a gradient, read from its FSDP2
    parameter `group`; None where FSDP2's state cannot be read."""
    param = _fsdp_param_of(local, group)
    try:
        return None if param is None else param.sharded_param.requires_grad
    except AttributeError:
        return None


def _fsdp_param_of(local, group):
    """The FSDP2 parameter of `group` whose local shard is `local`, or None (none, or no state to read)."""
    try:
        return next((param for param in group.fsdp_params if param._sharded_local_tensor is local), None)
    except AttributeError:
        return None


def param_groups(states):
    """The parameter groups of FSDP2's `states`, in their order; none where FSDP2's state cannot be read."""
    for state in states:
        try:
            groups = getattr(state, "_fsdp_param_groups", None)
            groups = [g for g in (groups if groups is not None else [state._fsdp_param_group]) if g is not None]
        except (AttributeError, AssertionError):
            continue
        yield from groups


def fsdp_param_of(module, local):
    """FSDP2's parameter of `module` whose local shard is `local`, or None (not sharded by FSDP2,
    or its state cannot be read)."""
    group, _ = _param_group_of(module)
    return _fsdp_param_of(local, group) if group is not None else None


def regather_afresh(param) -> None:
    """Let FSDP2 size the next all-gather of its parameter `param` anew: FSDP2 makes a parameter's
    gather buffers and its unsharded parameter at its first gather, for that gather's tensors, and
    reuses them after; a precision schedule that changes the parameter's format changes those
    tensors. Call it while the parameter is sharded (between steps)."""
    param.all_gather_outputs = []  # made again, at the new sizes, by the next gather
    param.__dict__.pop("_unsharded_param", None)  # so the next gather makes it as at the first
    param.__dict__.pop("_unsharded_inner_tensors", None)
