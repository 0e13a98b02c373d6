"""DynamicWeight: a layer weight that keeps its high-precision values and is quantized at use
(`weights="dynamic"`); any torch optimizer trains it as a plain parameter."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..distributed import fsdp, fsdp_state
from . import quantized_stack, traced_state
from ..core import running_state
from ..core.kernels import is_fake
from .config import LinearQuantizers
from ..core.numerics import all_reduce_max, ceil_div, sharded_cast
from ..core.quantizer import autocast_off, fold_to_2d
from ..core.tensor import QuantizedTensor, split_rebuilt, traced_reduction
from .weight import LayerWeight, note_gathered, quantized_weight


@dataclass(frozen=True)
class ShardCast:
    """FSDP2's cast of a dynamic weight's local shard, kept while `key` (`DynamicWeight._shard_key`:
    the values' version and dtype, the quantizer's running state) is unchanged."""

    key: tuple
    quantized: QuantizedTensor
    # The amaxes the cast took, already reduced (`ReducedAmaxes`), or None: it reduced its own.
    reduced: "ReducedAmaxes | None" = None


@dataclass(frozen=True)
class ReducedAmaxes:
    """A shard's tensor-wide amaxes, already reduced over `groups` in one collective with other
    shards' (`_batched_amaxes`), for its cast of the values `key` names."""

    key: tuple
    groups: tuple
    amaxes: list

    def matches(self, key: tuple, groups: tuple) -> bool:
        return self.key == key and self.groups == groups


class DynamicWeight(LayerWeight, torch.Tensor):
    """A high-precision weight that quantizes itself with its layer's weight quantizer each time
    F.linear uses it, so new values are always picked up; any optimizer trains it.

    A `__torch_dispatch__` wrapper over the plain tensor `_data`: every op computes on `_data`, and
    the ops that make a new piece of the same weight (FSDP2's chunk / new_zeros / narrow / view,
    nn.Module's to / empty_like, detach, clone, ...) give back a DynamicWeight with the same
    quantizers, so a shard never silently loses them. In-place ops (optimizer steps, copy_, init)
    write into `_data`. Everything else returns plain tensors.

    The quantized copy is cached (`quantized()`): gradient accumulation over several micro-batches
    quantizes the weight once per optimizer step, and any write into the values (through this
    tensor, an alias of it, or its inner tensor) invalidates the copy before it could be read.
    """

    linear_quantizers: LinearQuantizers
    _data: torch.Tensor
    _writes: "_WriteLog"
    # FSDP2 (fsdp_pre_all_gather): the last cast of the local shard, and amaxes reduced for the next.
    shard_cast: ShardCast | None = None
    reduced_amaxes: ReducedAmaxes | None = None
    # The weight quantizer whose casts' columnwise copy gathers rebuild from the rowwise one.
    rowwise_cast_suffices: object = None

    @staticmethod
    def __new__(
        cls, data: torch.Tensor, linear_quantizers: LinearQuantizers, requires_grad: bool | None = None, *, writes=None
    ):
        requires_grad = data.requires_grad if requires_grad is None else requires_grad
        data = data.detach()
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            layout=data.layout,
            requires_grad=requires_grad,
        )
        self._data = data
        self.linear_quantizers = linear_quantizers
        self._writes = writes if writes is not None else _WriteLog()
        return self

    def __init__(self, *args, **kwargs):
        pass

    quantized_at_use = True

    @property
    def stored_transposed(self) -> bool:
        return self.linear_quantizers.transposed

    def plain(self) -> torch.Tensor:
        """The high-precision values as a plain tensor (an alias)."""
        return self._data

    def high_precision_matrix(self) -> torch.Tensor:
        """The values as the [out_features, in_features] matrix the GEMMs read."""
        return self._data.t() if self.linear_quantizers.transposed else self._data

    def linear_operand(self, *, columnwise: bool, training: bool):
        """The values quantized for this call (see `quantized`), the amax notes of the cast, and
        the version of the values it was cast from (None under torch.compile: record every cast)."""
        if self.linear_quantizers.weight is None:
            return self.high_precision_matrix(), [], None
        if not self.linear_quantizers.records_amaxes:  # a stateless cast notes nothing
            notes = []
            quantized = self.quantized(columnwise=columnwise, cached=training)
        else:
            with running_state.noting() as notes:
                quantized = self.quantized(columnwise=columnwise, cached=training)
        traced = torch.compiler.is_compiling() or is_fake(self._data)
        return quantized, notes, None if traced else (id(self._writes), self.values_version())

    def values_version(self) -> tuple:
        """Changes whenever the values may have changed: writes through this tensor or its aliases
        (counted in __torch_dispatch__, where torch's version counters do not move), writes into
        the inner tensor from outside (its version counter), and writes into plain views of this
        tensor such as `w.detach()[5]` (autograd makes them share this tensor's version counter)."""
        return self._writes.count, self._data._version, self._version

    def quantized(self, *, columnwise: bool, cached: bool = True) -> QuantizedTensor:
        """The values quantized with the layer's weight quantizer (rowwise, plus columnwise when
        asked), from the cache while the values and the quantizer's running state are unchanged:
        the micro-batches of one optimizer step share the cast of the second (the first cast is
        not kept, so a step without gradient accumulation holds no weight cast past its backward).
        `cached=False` casts afresh and leaves the cache alone (the linear passes it for inference
        forwards, which cast as a model restored from a checkpoint would)."""
        linear = self.linear_quantizers
        quantizer = linear.weight
        values = self._data.t() if linear.transposed else self._data
        uncached = not cached or torch.compiler.is_compiling() or is_fake(self._data)
        if uncached or self._data.is_meta or self._data.is_inference():
            return quantizer.quantize(values, rowwise=True, columnwise=columnwise)
        # Aliases share one log: pieces of one weight (cross-attention's q, k, v rows of a packed
        # in_proj_weight) are told apart by where their values lie.
        piece = (self._data.data_ptr(), tuple(self._data.shape), self._data.stride(), linear.transposed)
        seen = self._writes.quantized.get(piece)
        version = (self.values_version(), quantizer.state_version())
        if seen is not None and seen.reusable(version, quantizer, columnwise):
            return seen.quantized
        quantized = quantizer.quantize(values, rowwise=True, columnwise=columnwise)
        if torch._C._current_graph_task_id() != -1:
            return quantized  # activation recomputation repeats a forward: it is not another micro-batch
        # The first cast of these values is only noted: kept, it would stay allocated through the
        # backward and the optimizer step, where a step without gradient accumulation never reads
        # it again. A second forward over the same values shows micro-batches: that cast is kept.
        # Keyed on the quantizer's running state too: a history written since (the first
        # micro-batch's record, a load) makes the next use cast again, and keeps that cast.
        second = seen is not None and seen.version[0] == version[0] and seen.quantizer is quantizer
        self._writes.quantized[piece] = WeightCast(version, quantizer, quantized if second else None)
        return quantized

    # torch's traceable-subclass protocol (DTensor, torch.compile, nn.Module._apply's swap), with the
    # layer's running state among the inner tensors (traced_state.py).
    def __tensor_flatten__(self):
        return ["_data", *traced_state.inner_names(self, self._data)], self.linear_quantizers

    @staticmethod
    def __tensor_unflatten__(inner_tensors, linear_quantizers, outer_size, outer_stride):
        weight = DynamicWeight(inner_tensors["_data"], linear_quantizers)
        traced_state.bind(weight, inner_tensors)
        return weight

    def __reduce_ex__(self, protocol):
        return traced_reduction(self, self._reduction(protocol)) if is_fake(self._data) else self._reduction(protocol)

    def _reduction(self, protocol):
        if self.__dict__.get("_is_param"):
            # A parameter of a pickled module: keep it a DynamicWeight parameter.
            return _rebuild_dynamic_parameter, (self._data, self.requires_grad, self.linear_quantizers)
        # state_dict entries pickle as plain tensors: loadable with weights_only=True, and
        # load_state_dict copies them into the weight.
        return self._data.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        duplicate = DynamicWeight(copy.deepcopy(self._data, memo), self.linear_quantizers, self.requires_grad)
        # The copy starts with its own write log and no cached quantized copies.
        left_out = ("_data", "_writes", "shard_cast", "reduced_amaxes", "rowwise_cast_suffices", "gathered_writes")
        state = {k: v for k, v in self.__dict__.items() if k not in left_out}
        duplicate.__dict__.update(copy.deepcopy(state, memo))
        return duplicate

    def __repr__(self, *, tensor_contents=None):
        return f"DynamicWeight({self._data!r}, linear_quantizers={self.linear_quantizers.describe()})"

    # ---- FSDP2: quantize the local shard, gather its low-precision bytes (fsdp.py) -------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        sharding = self._note_fsdp(mesh, module)
        linear = self.linear_quantizers
        if self.dim() == 3 and quantized_stack.gathers_as_experts(linear, outer_size, mesh, sharding):
            stack = self._quantized_experts(mp_policy.param_dtype)
            inputs, metadata = stack.fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)
            if torch._C._current_graph_task_id() != -1 and fsdp_state.trains(self, sharding.param_group):
                self.shard_cast = None  # as below: the re-gather before the backward is the cast's last use
            return inputs, ("experts", outer_size, (stack, metadata))
        # The weight role in high precision, or a Conv1D's [in, out] weight: FSDP2 shards it along
        # in_features, across the rows of what the GEMM reads, so it gathers its high-precision
        # values and is quantized at use, as on one process.
        if not self._casts_shard():
            values = self._data if mp_policy.param_dtype is None else self._data.to(mp_policy.param_dtype)
            padded = values.new_zeros((ceil_div(outer_size[0], mesh.size()), *outer_size[1:]))
            padded[: values.shape[0]].copy_(values)
            fsdp.count_gather((padded,), mesh, outer_size)
            return (padded,), (None, outer_size, None)
        quantized = self._quantized_shard(mp_policy.param_dtype, sharding)
        needed = fsdp.directions_needed(linear, fsdp_state.regathers_before_backward(sharding))
        inputs, plan = fsdp.pre_all_gather(quantized, mesh, outer_size, needed, linear.parameter_name)
        if torch._C._current_graph_task_id() != -1 and fsdp_state.trains(self, sharding.param_group):
            # The pre-backward re-gather is the last use of this cast before the optimizer step
            # writes the values: not kept until then (a byte or more per parameter of every layer).
            # Its reduced amaxes are: another micro-batch (gradient accumulation) casts again from
            # them, with no new all-reduce. A frozen weight keeps its cast.
            self.shard_cast, self.reduced_amaxes = None, self.shard_cast.reduced
        return inputs, (plan, outer_size, quantized)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        plan, outer_size, quantized = metadata
        if plan == "experts":  # the shard's experts as a QuantizedStack: the gathered stack is one too
            stack, stack_metadata = quantized
            return stack.fsdp_post_all_gather(all_gather_outputs, stack_metadata, param_dtype, out=out)
        if plan is None:
            (gathered,) = all_gather_outputs
            values = gathered[: outer_size[0]].reshape(outer_size).to(param_dtype)
            # The gathered weight is written with its version counter kept: where this shard's values
            # changed since the last gather (an optimizer step), it counts a write, as the parameter of
            # one process does, so that its kept casts (and delayed scaling's record of the weight's
            # amax) are made again; another gather of the same values (the next micro-batch) is not one.
            written, self.gathered_writes = self.__dict__.get("gathered_writes") != self._writes.count, self._writes.count
            if out is not None:
                out = getattr(out, "_local_tensor", out)  # a DTensor over tensor parallelism
                with torch.autograd._unsafe_preserve_version_counter(out._data):  # as fsdp._write_into
                    out._data.copy_(values)
                if written:
                    out._writes.record_write()
                return None
            unsharded = DynamicWeight(values.clone(), self.linear_quantizers)
            return unsharded, (unsharded._data,)
        result = fsdp.post_all_gather(quantized, all_gather_outputs, plan, outer_size, param_dtype, out=out)
        # The gathered weight carries its shard's cast notes: the first training step that uses
        # this version of the values records its amax (linear.py), an evaluation forward does not.
        target = getattr(out, "_local_tensor", out) if out is not None else result[0]
        note_gathered(target, plan)
        cast = target.gathered_cast
        cast.notes, cast.version = quantized.shard_notes
        return result

    def _quantized_shard(self, param_dtype: torch.dtype | None, sharding) -> QuantizedTensor:
        """The local shard quantized in the directions gathers send, once per version of the weight
        and of its quantizer's running state (the pre-backward re-gather reuses the forward's cast,
        as a single process quantizes once), with tensor-wide amaxes reduced over the groups its pieces are spread
        over (`sharding.shard_groups`, an `fsdp_state.FsdpLayer`) so that every shard
        shares one scale: reduced before, for every stale dynamic weight of the model in one
        collective (`_batched_amaxes`), or by the cast itself. Its amax notes travel with it, not
        written here. The values are cast from `param_dtype` (FSDP2's MixedPrecisionPolicy; None:
        the parameter's own), converted only when the cast is made."""
        quantizer = self.linear_quantizers.weight
        key = self._shard_key(param_dtype or self._data.dtype)
        if self.shard_cast is not None and self.shard_cast.key == key:
            return self.shard_cast.quantized
        values = self._data if param_dtype is None else self._data.to(param_dtype)
        amaxes = _batched_amaxes(self, values, key, sharding)
        reduction = sharded_cast(sharding.shard_groups, reduced=amaxes, owner=self.linear_quantizers.parameter_name)
        # A columnwise copy rebuilt after each gather from the rowwise one (Float8's transpose) is
        # never sent: once a cast by this quantizer showed that, the shard is cast rowwise only
        # (the gathered tensor made by the first gather keeps its columnwise buffers).
        columnwise = self.rowwise_cast_suffices is not quantizer
        with running_state.noting() as notes, reduction, autocast_off(values.device.type):
            cast = quantizer.quantize(values, rowwise=True, columnwise=columnwise)
        quantized = quantized_weight(cast, self.linear_quantizers)
        if columnwise and split_rebuilt(quantized, ("columnwise",))[0] == ("columnwise",):
            self.rowwise_cast_suffices = quantizer
        quantized.shard_notes = (notes, (id(self._writes), key[0]))
        reduced = ReducedAmaxes(key, sharding.shard_groups, amaxes) if amaxes is not None else None
        self.shard_cast = ShardCast(key, quantized, reduced)
        return quantized

    def _quantized_experts(self, param_dtype: torch.dtype | None):
        """The local shard of a stack, whole experts, as a QuantizedStack (each expert cast on its own
        in both directions), once per version of the values, from `param_dtype` as `_quantized_shard`."""
        key = self._shard_key(param_dtype or self._data.dtype)
        if self.shard_cast is None or self.shard_cast.key != key:
            values = self._data if param_dtype is None else self._data.to(param_dtype)
            with autocast_off(values.device.type):
                self.shard_cast = ShardCast(key, quantized_stack.quantized_stack(values, self.linear_quantizers))
        return self.shard_cast.quantized

    def _shard_key(self, dtype: torch.dtype) -> tuple:
        """What the cast of the local shard depends on: the values' version and dtype, and the
        weight quantizer's running state."""
        return (self.values_version(), dtype, self.linear_quantizers.weight.state_version())

    def _casts_shard(self) -> bool:
        """Whether FSDP2's hook quantizes this shard as one matrix (else it gathers high-precision
        values). Not an expert stack: each expert's cast is its own, which a cast of a shard of
        experts as one matrix would not be (a stack gathers its experts' casts where
        `quantized_stack.gathers_as_experts`, else its values)."""
        linear = self.linear_quantizers
        return linear.weight is not None and not linear.transposed and self.dim() == 2

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.copy_.default and isinstance(args[1], DynamicWeight) and traced_state.has_bound_state(args[1]):
            return _write_back(*args[:2])
        weights = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, DynamicWeight)]
        plain_args, plain_kwargs = tree_map_only(DynamicWeight, lambda t: t._data, (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        _count_writes(func, args, kwargs)
        # An expert stack's pieces: one expert's matrix, and the stack with its matrices the other way
        # round (`stack.transpose(-2, -1)`, which a grouped GEMM reads; layers/experts.py).
        expert = args and getattr(args[0], "ndim", 0) == 3 and (
            (func is aten.select.int and args[1] in (0, -3)) or (func is aten.transpose.int and {args[1] % 3, args[2] % 3} == {1, 2})
        )
        if (func in _DYNAMIC_WEIGHT_PIECES or expert) and _keeps_float(func, out):
            source = weights[0]
            # An alias shares the write log (a write through it changes the source's values).
            writes = source._writes if func in _ALIASES or expert else None
            linear = source.linear_quantizers
            if func is aten.select.int and linear.experts:  # one expert's matrix: cast with that expert's configuration
                linear = linear.experts[args[2]]
            wrapped = tree_map_only(torch.Tensor, lambda t: DynamicWeight(t, linear, writes=writes), out)
            # A stack's piece is a view of the stack: told to autograd and torch.compile as one, so a compiled
            # graph that hands it to the experts' (eager) grouped GEMM makes it again from the stack.
            return return_and_correct_aliasing(func, args, kwargs, wrapped) if expert else wrapped
        # An in-place op hands back the tensor it wrote into: the wrapper, not its inner tensor.
        if args and isinstance(args[0], DynamicWeight) and out is plain_args[0]:
            return args[0]
        return out


# ---- FSDP2: the tensor-wide amaxes of every stale shard of a model, reduced in one collective -----
def _batched_amaxes(weight: DynamicWeight, values: torch.Tensor, key: tuple, sharding) -> list[torch.Tensor] | None:
    """The tensor-wide amaxes of the cast of `weight`'s shard (`values`, `key`), already reduced over
    the groups its pieces are spread over (`sharding.shard_groups`), or None: the cast reduces its own.

    The first stale shard the hooks cast (values written since their last cast, by the optimizer
    step or a load) reduces, in one all-reduce over each of the groups, its own local amaxes and
    those of every other stale dynamic weight shard of its FSDP2 model (`sharding.model_groups`)
    spread over the same groups, and keeps each shard's reduced amaxes for that shard's cast later in
    the same forward. FSDP2 calls the hooks in the same order on every rank, lists the model's
    parameter groups in the same order on every rank, and which shards are stale is the same on
    every rank, so every rank issues this collective at the same point. A shard whose values change
    again before its cast, one that FSDP2's state does not show (CPU offloading), one whose quantizer
    does not declare its amaxes, and traced casts (torch.compile) reduce their own amaxes as before."""
    groups = sharding.shard_groups
    stored, weight.reduced_amaxes = weight.reduced_amaxes, None
    if stored is not None and stored.matches(key, groups):
        return stored.amaxes
    if torch.compiler.is_compiling() or is_fake(weight._data) or weight._data.is_meta:
        return None
    layer_group = sharding.param_group
    if layer_group is None or not any(p.local is weight for p in fsdp_state.sharded_parameters([layer_group])):
        return None
    with autocast_off(values.device.type):
        amaxes = weight.linear_quantizers.weight.tensor_amaxes(fold_to_2d(values), True, True)
    if amaxes is None:
        return None
    batch = [(weight, key, amaxes)]  # (shard, the key of its cast, its local amaxes)
    for parameter in fsdp_state.sharded_parameters(sharding.model_groups):
        shard = parameter.local
        if shard is weight or not isinstance(shard, DynamicWeight) or not shard._casts_shard() or shard._data.is_meta:
            continue
        if parameter.groups != groups:
            continue
        shard_values = shard._data if parameter.param_dtype is None else shard._data.to(parameter.param_dtype)
        shard_key = shard._shard_key(shard_values.dtype)
        if not _stale(shard, shard_key, groups):
            continue
        with autocast_off(shard_values.device.type):
            shard_amaxes = shard.linear_quantizers.weight.tensor_amaxes(fold_to_2d(shard_values), True, True)
        if shard_amaxes is not None:
            batch.append((shard, shard_key, shard_amaxes))
    flat = [amax.reshape(1).float() for _, _, shard_amaxes in batch for amax in shard_amaxes]
    if flat:
        reduced = torch.cat(flat)
        all_reduce_max(reduced, groups)
        reduced = iter(reduced.unbind())
    taken = [[next(reduced).clone() for _ in shard_amaxes] for _, _, shard_amaxes in batch]
    for (shard, shard_key, _), reduced_amaxes in zip(batch[1:], taken[1:]):
        shard.reduced_amaxes = ReducedAmaxes(shard_key, groups, reduced_amaxes)
    return taken[0]


def _stale(shard: DynamicWeight, key: tuple, groups: tuple) -> bool:
    """Whether the shard's next cast needs amaxes it neither holds cast nor has reduced already."""
    cached, stored = shard.shard_cast, shard.reduced_amaxes
    return not (cached is not None and cached.key == key) and not (stored is not None and stored.matches(key, groups))


def _write_back(target: DynamicWeight, source: DynamicWeight) -> DynamicWeight:
    """`target.copy_(source)` from a traced weight: how the compiled step writes the layer state it
    updated back into the weight it was given, with the values where they are another tensor."""
    traced_state.copy_state(target, source)
    if not traced_state.same_values(source._data, target._data):
        target._data.copy_(source._data)
        target._writes.record_write()
    return target


@dataclass(frozen=True)
class WeightCast:
    """The last cast of one piece of a dynamic weight's values: the version of the values and of the
    quantizer's running state it was made from, the quantizer, and the quantized tensor where it is
    kept (from the second cast of the same values on), else None."""

    version: tuple
    quantizer: object
    quantized: QuantizedTensor | None

    def reusable(self, version: tuple, quantizer, columnwise: bool) -> bool:
        """Whether the kept cast serves a use of these values by this quantizer in these directions."""
        return (
            self.quantized is not None and self.version == version and self.quantizer is quantizer
            and (self.quantized.has_columnwise or not columnwise)
        )


class _WriteLog:
    """Shared by a DynamicWeight and its aliases: how many in-place writes went through any of them,
    and the last cast of the values with the quantized copy kept from the second cast on (dropped at
    the first write, so it never outlives them)."""

    __slots__ = ("count", "quantized")

    def __init__(self):
        self.count = 0
        self.quantized: dict[tuple, WeightCast] = {}  # by piece of the values (`DynamicWeight.quantized`)

    def record_write(self) -> None:
        self.count += 1
        self.quantized = {}


def _count_writes(func, args, kwargs) -> None:
    """Count in-place writes into each DynamicWeight (optimizer steps, copy_, init): its cached
    quantized copies are stale once it changes. The inner tensor's own version counter does not
    move for writes made from inside __torch_dispatch__, so the wrapper keeps its own count."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
        for tensor in tree_flatten(value)[0]:
            if isinstance(tensor, DynamicWeight):
                tensor._writes.record_write()


def _keeps_float(func, out) -> bool:
    """A piece in a non-float dtype (`.to(torch.int8)`) is a plain tensor, not a weight."""
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return all(t.dtype.is_floating_point for t in leaves)


aten = torch.ops.aten
# Ops whose result aliases (a piece of) the same weight's values: FSDP2 sends chunk/split,
# slice/narrow, view and as_strided; nn.Module sends detach.
_ALIASES = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
}
# Ops whose result is (a piece of) the same weight: the aliases, and new tensors of it (FSDP2's
# new_zeros, nn.Module's _to_copy, empty_like (to_empty) and clone).
_DYNAMIC_WEIGHT_PIECES = _ALIASES | {
    aten.clone.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.empty_like.default,
    aten._to_copy.default,
    aten._pin_memory.default,
}


def _rebuild_dynamic_parameter(data: torch.Tensor, requires_grad: bool, linear_quantizers: LinearQuantizers):
    return torch.nn.Parameter(DynamicWeight(data, linear_quantizers), requires_grad=requires_grad)
