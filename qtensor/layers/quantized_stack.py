"""QuantizedStack: an expert stack held in low precision (`quantize_(..., weights="quantized")`).

A stack `[experts, out, in]` (or `[experts, in, out]`, kept so by its module: experts.py) is E
matrices, each the quantized weight of its expert's linear, cast on its own with its expert's
weight quantizer in both directions, as a dense layer's quantized weight is (weight.py). The stack
holds no high-precision values: its bytes are the E casts'.

Every buffer of the E casts is one tensor `[experts, ...]` (`stacked`), and each expert's quantized
weight is a view of its row of each: a grouped GEMM reads all experts' codes and scales in place
(`GroupedOperand`s of the Float8 formats, `stacked_operands`), a loader or `copy_` writes each
expert's bytes through its views, and the stack's dim-0 pieces are the experts' own casts.

A model multiplies the stack as it would a dynamic one (experts.py, routing.py): `stack[e]` is
expert e's quantized weight, a grouped or batched GEMM runs each group through its expert. The
optimizer trains it through `qtensor.optim.MasterWeights`, whose step writes the masters back with
`copy_` (each expert cast again). Its `state_dict` entries are the experts' quantized weights,
`expert_weights.<stack>.<e>` in its module (stack_ops.py), so files store and check each expert's
format as a dense quantized weight's. FSDP2 shards it into whole experts and gathers their bytes
as they are (`fsdp_pre_all_gather` / `fsdp_post_all_gather`).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..core import tensor as core_tensor
from ..core.numerics import sharded_cast
from ..core.groups import GroupedCopy, GroupedOperand, RowGroups
from ..core.tensor import QuantizedTensor
from ..distributed import fsdp, packing
from .config import LinearQuantizers
from .weight import LayerWeight, quantized_weight

aten = torch.ops.aten


class QuantizedStack(LayerWeight, torch.Tensor):
    """E quantized expert matrices as one `[experts, ...]` layer weight (see the module docstring)."""

    quantized_at_use = False
    # Its ops (layers/stack_ops.py fills them): handler by aten op, and the ops that make views.
    _ops: dict = {}
    _views: frozenset = frozenset()
    stacked: dict  # (direction, buffer name) -> [experts, ...]: every expert's buffer, expert e's a view of row e
    expert_layout: "ExpertLayout"  # what every expert shares

    @staticmethod
    def __new__(cls, experts, stacked: dict, linear: LinearQuantizers, *, shape=None, stride=None, requires_grad=False, layout=None):
        """Over `experts` (each expert's quantized weight), or with `experts` None over `stacked` and
        `layout` alone: the experts' weights are then made when first asked for (`experts`), so a
        stack that a grouped GEMM reads in place, or that FSDP2 gathers, never makes 128 of them."""
        layout = layout or ExpertLayout.of(experts[0])
        count = len(experts) if experts is not None else next(iter(stacked.values())).shape[0]
        out_features, in_features = layout.shape
        if shape is None:
            shape = (count, in_features, out_features) if linear.transposed else (count, out_features, in_features)
            stride = (shape[1] * shape[2], shape[2], 1)
        device = next(iter(stacked.values())).device
        self = torch.Tensor._make_wrapper_subclass(cls, shape, strides=stride, dtype=layout.dtype, device=device, requires_grad=requires_grad)
        self._experts = tuple(experts) if experts is not None else None
        self.stacked, self.linear_quantizers, self.expert_layout = stacked, linear, layout
        return self

    @property
    def experts(self) -> tuple:
        """Each expert's quantized weight, [out, in]: views of its row of every stacked buffer."""
        if self._experts is None:
            first = [self._first] if "_first" in self.__dict__ and self.shape[0] else []  # made alone before: kept as expert 0
            rest = _expert_views(self.stacked, self.expert_layout, self.linear_quantizers, range(len(first), self.shape[0]))
            self._experts = tuple(first + rest)
        return self._experts

    def first_expert(self) -> QuantizedTensor:
        """Expert 0's quantized weight (its storages tell the format's layout), made alone where the
        others are not made yet; of a stack with no expert (FSDP2's shard of a rank that holds none),
        an expert of zero codes in the stack's layout."""
        if self._experts:
            return self._experts[0]
        if "_first" not in self.__dict__:
            stacked = self.stacked if self.shape[0] else map_stacked(self.stacked, lambda t: t.new_zeros((1, *t.shape[1:])))
            self._first = _expert_views(stacked, self.expert_layout, self.linear_quantizers, [0])[0]
        return self._first

    def __init__(self, *args, **kwargs):
        pass

    @property
    def stored_transposed(self) -> bool:
        return self.linear_quantizers.transposed

    def _data_attribute(self, name):
        key = tuple(name.split("__", 1))
        if key in self.__dict__.get("stacked", {}):  # an inner tensor (__tensor_flatten__)
            return self.stacked[key]
        return super()._data_attribute(name)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stack's values as a plain tensor of its shape (each expert's rowwise copy dequantized)."""
        dtype = dtype or self.dtype
        if not self.shape[0]:  # FSDP2's shard of a rank that holds no expert
            values = torch.empty((0, *self.expert_layout.shape), dtype=dtype, device=self.device)
        else:
            values = torch.stack([expert.dequantize(dtype) for expert in self.experts])  # [E, out, in]
        swapped = self.stride(-1) != 1 and self.stride(-2) == 1  # a transposed view of the stack as kept
        return values.transpose(-2, -1).contiguous() if self.stored_transposed != swapped else values

    def high_precision_matrix(self) -> torch.Tensor:
        return self.dequantize()

    def storage_nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.stacked.values())

    def stacked_operands(self, rowwise: bool, columnwise: bool):
        """(rowwise, columnwise) `GroupedOperand`s over the experts' bytes in place, as
        `Quantizer.quantize_stack` gives them (a Float8 weight quantizer with grouped casts)."""
        return tuple(self._operand(direction) if wanted else None for direction, wanted in (("rowwise", rowwise), ("columnwise", columnwise)))

    def _operand(self, direction: str) -> GroupedOperand:
        data, scale_inv = self.stacked[(direction, "data")], self.stacked[(direction, "scale_inv")]
        experts, rows = data.shape[0], data.shape[1]
        # A tensor scale per expert (stacked [E, 4]: see `_stacked`) or one per row of each ([E, rows, 1]),
        # as one factor per row.
        per_expert = scale_inv.flatten(1)  # (a shard of no experts too)
        per_expert = per_expert[:, :1] if getattr(self.first_expert(), direction).buffers["scale_inv"].dim() == 0 else per_expert
        return GroupedOperand(data, per_expert.expand(experts, rows).contiguous())

    def grouped_copy(self, direction: str) -> GroupedCopy | None:
        """The experts' `direction` copies as one `[experts · out, in]` GroupedCopy over the stacked
        bytes (views where each buffer's rows come first, else one copy of the codes), where every
        buffer follows the rows and each expert's rows fill whole entries of it (experts of whole
        blocks of rows); a tensor-wide buffer (NVFP4's global amax) gives each expert's own. None
        where an expert's rows do not fill whole entries."""
        first, count = self.first_expert(), self.shape[0]
        rows = first.shape[0]
        storage, buffers, group_scales = getattr(first, direction), {}, None
        for spec in storage.buffer_specs():
            stacked = self.stacked[(direction, spec.name)]
            if spec.tensor_wide:  # stacked [E, 4], each expert's at the start of its row (`_stacked`)
                group_scales = stacked[:, 0]
                buffers[spec.name] = torch.full((), float("nan"), device=stacked.device)  # never read: see GroupedCopy
                continue
            if spec.entries(rows * count) != count * spec.entries(rows):
                return None
            shape = list(stacked.shape[1:])
            shape[spec.row_axis] *= count
            buffers[spec.name] = stacked.movedim(0, spec.row_axis).reshape(shape)
        return GroupedCopy(storage.rebuilt(buffers, rows=rows * count), group_scales)

    def requantize(self, values: torch.Tensor) -> None:
        """Cast `values` (the stack's shape) into the experts' bytes, each expert on its own: whole on
        this rank even where the stack is a shard of experts (FSDP2), so no amax is reduced over ranks."""
        if not self.shape[0]:  # FSDP2's shard of a rank that holds no expert: nothing to cast
            return
        values = values.to(device=self.device, dtype=self.dtype)  # as copy_ casts a quantized weight: from its own dtype
        matrices = values.transpose(-2, -1) if self.stored_transposed else values  # [E, out, in]
        with sharded_cast((), owner="QuantizedStack.requantize"):
            stacked = None if self.linear_quantizers.experts else _cast_at_once(self.linear_quantizers.weight, matrices, self.first_expert())
            if stacked is None:
                for expert, matrix in zip(self.experts, matrices):
                    expert.copy_(matrix)
                return
        for key, owner in _owners(self.stacked).items():
            if owner == key:
                self.stacked[key].copy_(stacked[key])

    def __repr__(self, *, tensor_contents=None):
        if not self.shape[0]:
            return f"QuantizedStack(no experts, shape={list(self.shape)})"
        return f"QuantizedStack({self.shape[0]} experts of {self.first_expert()!r}, shape={list(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = cls._ops.get(func)
        if handler is None:
            return _on_values(func, args, kwargs)
        out = handler(func, args, kwargs)
        # A view of the stack is another stack over the same bytes: told to autograd and torch.compile as a view.
        return return_and_correct_aliasing(func, args, kwargs, out) if func in cls._views and isinstance(out, QuantizedStack) else out

    # ---- FSDP2: a shard of whole experts (stack_ops.py makes the pieces), gathered as its bytes ----
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        owners = _owners(self.stacked)
        sent = [key for key in self.stacked if owners[key] == key]  # each buffer once (one both directions share)
        inputs = tuple(self.stacked[key] for key in sent)
        # Uneven: FSDP2 wants one input of the padded shard's shape. On one rank FSDP2 (torch 2.11 to
        # 2.13) copies only the first input into its output. Either way the bytes go packed in one.
        packed = outer_size[0] % mesh.size() != 0 or (mesh.size() == 1 and len(inputs) > 1)
        if packed:
            inputs = (packing.packed_experts(list(inputs), (-(-outer_size[0] // mesh.size()), *outer_size[1:])),)
        fsdp.count_gather(inputs, mesh, outer_size)
        unpacking = ([self.stacked[key] for key in sent], mesh.size()) if packed else None  # (templates, ranks)
        return inputs, (sent, owners, self.expert_layout, outer_size, outer_stride, unpacking)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        sent, owners, layout, outer_size, outer_stride, unpacking = metadata
        outputs = all_gather_outputs
        if unpacking is not None:  # packed (uneven shards): each rank's experts cut out, the padding dropped
            templates, ranks = unpacking
            outputs = packing.unpacked_experts(all_gather_outputs[0], templates, ranks, outer_size[0])
        gathered = dict(zip(sent, outputs))
        if out is not None:  # the gathered stack of the first gather, its buffers written again
            for key, values in gathered.items():
                if out.stacked[key].data_ptr() != values.data_ptr():
                    out.stacked[key].copy_(values)
            return None
        stacked = {key: gathered[owner] for key, owner in owners.items()}
        stack = _over_stacked(stacked, layout, self.linear_quantizers, shape=outer_size, stride=outer_stride, dtype=param_dtype)
        return stack, tuple(outputs)

    def __deepcopy__(self, memo):
        stacked, linear = copy.deepcopy((self.stacked, self.linear_quantizers), memo)
        duplicate = _over_stacked(stacked, self.expert_layout, linear, shape=self.shape, stride=self.stride())
        duplicate.requires_grad_(self.requires_grad)
        duplicate.__dict__.update({k: v for k, v in self.__dict__.items() if k == "_is_param"})
        return duplicate

    def __reduce_ex__(self, protocol):
        return _rebuild_stack, (self.stacked, _template(self), self.linear_quantizers, self.requires_grad)

    # torch's traceable-subclass protocol (nn.Module._apply's swap): the stacked buffers are the inner tensors.
    def __tensor_flatten__(self):
        names = [f"{direction}__{name}" for direction, name in self.stacked]
        return names, (_template(self), self.linear_quantizers)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, context, outer_size, outer_stride):
        layout, linear = context
        stacked = {tuple(key.split("__", 1)): tensor for key, tensor in inner_tensors.items()}
        return _over_stacked(stacked, layout, linear, shape=outer_size, stride=outer_stride)


def gathers_as_experts(linear: LinearQuantizers, outer_size, mesh, sharding) -> bool:
    """Whether FSDP2 gathers a dynamic stack's shard as a `QuantizedStack` of its experts' bytes
    (DynamicWeight.fsdp_pre_all_gather): each rank casts its own whole experts, each on its own, as
    one process casts them, and the gathered stack multiplies as a held one does. That needs
    experts split evenly over the mesh (FSDP2 pads an uneven split) and by FSDP2 alone (`sharding`,
    an `fsdp_state.FsdpLayer`: a tensor-parallel piece of each expert would need its tensor-wide
    amaxes reduced over the other pieces), no running state per expert (delayed scaling's, kept by
    the one-process cast) and no backward override (whose backward reads the original values):
    any other stack gathers its values, cast after the gather."""
    if linear.weight is None or linear.experts or linear.backward_override is not None:
        return False
    only_fsdp = sharding.shard_groups == (sharding.mesh_group,)
    return only_fsdp and mesh.size() > 1 and outer_size[0] % mesh.size() == 0


def quantized_stack(values: torch.Tensor, linear: LinearQuantizers) -> QuantizedStack:
    """The stack `values` (as its module keeps it) held quantized: each expert's [out, in] matrix cast
    in both directions by its expert's weight quantizer."""
    matrices = values.detach().transpose(-2, -1) if linear.transposed else values.detach()
    configs = linear.experts or (linear,) * matrices.shape[0]
    first = configs[0].weight.quantize(matrices[0], rowwise=True, columnwise=True)
    stacked = None if linear.experts else _cast_at_once(linear.weight, matrices, first)
    if stacked is None:
        casts = [first, *(config.weight.quantize(m, rowwise=True, columnwise=True) for config, m in zip(configs[1:], matrices[1:]))]
        stacked = _stacked(casts)
    return _over_stacked(stacked, first, linear)


def _cast_at_once(quantizer, matrices: torch.Tensor, like: QuantizedTensor) -> dict | None:
    """The stacked buffers (as `_stacked` lays them out) of every expert of `matrices` [E, out, in]
    cast by one `quantizer`, in a few launches for the whole stack, not a few per expert; the bytes
    each expert's own cast gives. `like` is an expert's cast (its layout). None where no such cast
    applies: then each expert is cast in turn.

    - Float8 with grouped casts (per-tensor or row-wise scales): `quantize_stack`, which scales each
      expert (or each row of it) on its own (formats/float8_groups.py);
    - a block format whose values bf16 holds (`group_block_rows`: MXFP8, NVFP4, their hybrid) over
      experts of whole blocks of rows: the stack as one [E·out, in] matrix in groups of `out` rows
      (`quantize_padded_groups`: each expert at its own tensor scale), each buffer then split into
      the experts' rows;
    - another format with no tensor-wide scale whose blocks fall within each expert: the stack cast
      as one [E·out, in] matrix, each buffer then split into the experts' rows."""
    experts, rows, cols = matrices.shape
    template = _stacked([like])  # one expert's buffers, [1, ...]
    block = quantizer.group_block_rows()
    if block is not None and rows % block == 0:
        groups = RowGroups((rows,) * experts, torch.arange(1, experts + 1, device=matrices.device) * rows, align=block)
        copies = quantizer.quantize_padded_groups(matrices.reshape(experts * rows, cols), groups, True, True)
        stacked = {}
        for direction, copy in zip(("rowwise", "columnwise"), copies):
            for spec in copy.storage.buffer_specs():
                key = (direction, spec.name)
                if spec.tensor_wide:  # each expert's own, as `_stacked` pads a scalar to 16 bytes
                    stacked[key] = torch.nn.functional.pad(copy.group_scales[:, None], (0, template[key].shape[1] - 1))
                else:
                    stacked[key] = _split_experts(getattr(copy.storage, spec.name), spec, experts)
    elif getattr(quantizer, "grouped_scaling", lambda: None)() in ("tensor", "row"):
        row, col = quantizer.quantize_stack(matrices, rowwise=True, columnwise=True)
        tensor_scaled = quantizer.grouped_scaling() == "tensor"
        scalar = lambda scale_inv: torch.nn.functional.pad(scale_inv[:, :1], (0, template[("rowwise", "scale_inv")].shape[1] - 1))
        stacked = {
            ("rowwise", "data"): row.data, ("columnwise", "data"): col.data,
            ("rowwise", "scale_inv"): scalar(row.scale_inv) if tensor_scaled else row.scale_inv.reshape(experts, rows, 1),
            ("columnwise", "scale_inv"): scalar(row.scale_inv) if tensor_scaled else col.scale_inv.reshape(experts, cols, 1),
        }
    else:
        storages = [getattr(like, direction) for direction in ("rowwise", "columnwise")]
        if any(spec.tensor_wide or spec.entries(rows * experts) != experts * spec.entries(rows) for storage in storages for spec in storage.buffer_specs()):
            return None
        whole = quantizer.quantize(matrices.reshape(experts * rows, cols), rowwise=True, columnwise=True)
        stacked = {}
        for direction in ("rowwise", "columnwise"):
            for spec in getattr(whole, direction).buffer_specs():
                stacked[(direction, spec.name)] = _split_experts(getattr(getattr(whole, direction), spec.name), spec, experts)
    if any(key not in stacked or stacked[key].shape[1:] != t.shape[1:] or stacked[key].dtype != t.dtype for key, t in template.items()):
        return None  # a layout this cast does not give: each expert in turn
    owners = _owners(template)  # a buffer both directions of a cast share stays one tensor
    owned = {owner: stacked[owner].contiguous() for owner in set(owners.values())}
    return {key: owned[owner] for key, owner in owners.items()}


def _stacked(casts) -> dict:
    """(direction, buffer name) -> the experts' buffers stacked along a new dim 0 (a buffer both
    directions of a cast share, stacked once). A tensor-wide scalar (Float8's scale) is stacked as
    [E, 4], each expert's at the start of its own 16 bytes: cuBLAS refuses a scale pointer that is
    not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED on an H100)."""
    stacked = {}
    for direction in ("rowwise", "columnwise"):
        for name in getattr(casts[0], direction).buffers:
            shared = [key for key in stacked if _buffer(casts[0], *key) is _buffer(casts[0], direction, name)]
            if shared:
                stacked[(direction, name)] = stacked[shared[0]]
                continue
            buffers = torch.stack([_buffer(c, direction, name) for c in casts])
            if buffers.dim() == 1:
                buffers = torch.nn.functional.pad(buffers[:, None], (0, 16 // buffers.element_size() - 1))
            stacked[(direction, name)] = buffers
    return stacked


def _split_experts(buffer: torch.Tensor, spec, experts: int) -> torch.Tensor:
    """A buffer of the [E·out, in] cast as [E, ...], each expert's entries along its row axis."""
    shape = list(buffer.shape)
    shape[spec.row_axis : spec.row_axis + 1] = [experts, shape[spec.row_axis] // experts]
    return buffer.reshape(shape).movedim(spec.row_axis, 0)


def _owners(stacked: dict) -> dict:
    """(direction, name) -> the first key holding the same tensor (a buffer both directions share)."""
    first = {}
    return {key: first.setdefault(id(tensor), key) for key, tensor in stacked.items()}


def map_stacked(stacked: dict, fn) -> dict:
    """`fn` of every stacked buffer, once each: a buffer both directions share stays one tensor."""
    owners = _owners(stacked)
    done = {key: fn(stacked[key]) for key, owner in owners.items() if owner == key}
    return {key: done[owner] for key, owner in owners.items()}


def _buffer(tensor: QuantizedTensor, direction: str, name: str) -> torch.Tensor:
    return getattr(tensor, direction).buffers[name]


class ExpertLayout(NamedTuple):
    """What every expert of a stack shares, by value (torch.compile guards on it): the format's tensor
    class, the matrix's shape and nominal dtype, and per direction the storage class, its options and
    which of its buffers are tensor-wide scalars."""

    data_class: type
    shape: tuple
    dtype: torch.dtype
    storages: tuple  # (direction, storage class, options as sorted items, scalar buffer names)

    @staticmethod
    def of(expert: QuantizedTensor, dtype: torch.dtype | None = None) -> "ExpertLayout":
        storages = tuple(
            (direction, type(storage), tuple(sorted(storage.options.items())), tuple(n for n, b in storage.buffers.items() if b.dim() == 0))
            for direction in ("rowwise", "columnwise")
            for storage in (getattr(expert, direction),)
        )
        return ExpertLayout(type(expert).data_class, tuple(expert.shape), dtype or expert.dtype, storages)

    def expert(self, buffers: dict, quantizer) -> QuantizedTensor:
        """An expert of this layout over `buffers` ((direction, name) -> tensor)."""
        rows, cols = self.shape
        storages = {
            direction: cls(direction=direction, rows=rows, cols=cols, **dict(options), **{n: t for (d, n), t in buffers.items() if d == direction})
            for direction, cls, options, _ in self.storages
        }
        return self.data_class(torch.Size(self.shape), self.dtype, storages["rowwise"], storages["columnwise"], quantizer)


def _template(stack: QuantizedStack) -> ExpertLayout:
    return stack.expert_layout


def _over_stacked(stacked: dict, layout, linear: LinearQuantizers, *, shape=None, stride=None, dtype=None) -> QuantizedStack:
    """A stack over `stacked` whose experts are views of row e of every stacked buffer (made when
    first asked for), each of `layout` (an `ExpertLayout`, or an expert to read it from) and its
    nominal dtype (or `dtype`)."""
    layout = layout if isinstance(layout, ExpertLayout) else ExpertLayout.of(layout)
    layout = layout._replace(dtype=dtype) if dtype is not None else layout
    return QuantizedStack(None, stacked, linear, shape=shape, stride=stride, layout=layout)


def _expert_views(stacked: dict, layout: ExpertLayout, linear: LinearQuantizers, experts) -> list:
    """The quantized weights of `experts` (indices) over their rows of every stacked buffer (a buffer
    both directions share stays one object per expert)."""
    scalars = {(direction, name) for direction, _, _, names in layout.storages for name in names}
    made = []
    for expert in experts:
        views = {}
        buffers = {key: views.setdefault(id(t), t[expert, 0] if key in scalars else t[expert]) for key, t in stacked.items()}
        config = linear.experts[expert] if linear.experts else linear
        made.append(quantized_weight(layout.expert(buffers, config.weight), config))
    return made


def _rebuild_stack(stacked: dict, layout, linear, requires_grad: bool):
    stack = _over_stacked(stacked, layout, linear)
    return torch.nn.Parameter(stack, requires_grad=requires_grad) if requires_grad else stack


class StackExpert(LayerWeight, torch.Tensor):
    """`stack[e]` of a stack held quantized and read as `[experts, in, out]` (a module that multiplies
    `x @ w[e]`, gpt-oss's): expert e's quantized weight as its `[in, out]` matrix. The matmul runs the
    expert's quantized linear (routing.py) and its weight gradient comes out `[in, out]`; any other op
    sees the dequantized values."""

    quantized_at_use = False
    stored_transposed = True

    @staticmethod
    def __new__(cls, expert):
        out_features, in_features = expert.shape
        self = torch.Tensor._make_wrapper_subclass(cls, (in_features, out_features), dtype=expert.dtype, device=expert.device)
        self.expert, self.linear_quantizers = expert, expert.linear_quantizers
        return self

    def __init__(self, *args, **kwargs):
        pass

    def linear_operand(self, *, columnwise: bool, training: bool):
        return self.expert.linear_operand(columnwise=columnwise, training=training)

    def high_precision_matrix(self) -> torch.Tensor:
        return self.expert.dequantize()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.expert.dequantize(dtype).t()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (aten.detach.default, aten.alias.default):
            return StackExpert(args[0].expert)
        return _on_values(func, args, kwargs or {})


def _on_values(func, args, kwargs):
    """Any other op: on the dequantized values, under `qtensor.fallbacks`' rule; an op that would write
    into the stack is refused."""
    for position, argument in enumerate(func._schema.arguments):
        written = argument.alias_info is not None and argument.alias_info.is_write
        if written and position < len(args) and isinstance(args[position], (QuantizedStack, StackExpert)):
            raise NotImplementedError(
                f"{args[position].linear_quantizers.parameter_name}: {func} would write into an expert stack held quantized; "
                "write its values with copy_ (each expert is cast again), or train it through qtensor.optim.MasterWeights."
            )
    core_tensor.note_fallback(func, type(args[0]).__name__ if args else "QuantizedStack")
    unwrap = lambda value: value.dequantize() if isinstance(value, (QuantizedStack, StackExpert)) else value
    return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})
