"""A linear layer's configuration: its quantizers by tensor role, its backward override, its name,
and the little running bookkeeping delayed scaling needs (which process group reduces its amaxes,
which version of its weight was recorded last)."""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from ..core.quantizer import Quantizer

BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


class LayerRunning:
    """Mutable bookkeeping of one layer, outside its configuration's value (compiled code guards on
    the configuration, never on this).

    - `amax_group`: what `quantize_(..., amax_reduction_group=)` was given: the process group whose
      ranks reduce this layer's delayed-scaling amaxes before they are recorded; `"local"`: none,
      each rank keeps its own histories; None: the default, settled at each reduction by `group()`.
    - `fsdp`: what FSDP2's hooks told the layer about how its weight is sharded (an `FsdpLayer`,
      distributed/fsdp_state.py), None until they run.
    - `recorded_weight`: the version of the weight's values whose amax was last recorded, so a
      weight's amax is recorded once per version of its values (docs/running-state.md).
    """

    __slots__ = ("amax_group", "fsdp", "recorded_weight")

    def __init__(self, amax_group=None):
        if isinstance(amax_group, bool) or isinstance(amax_group, str) and amax_group != LOCAL_AMAXES:
            raise ValueError(
                f"quantize_: amax_reduction_group={amax_group!r}; give a process group, {LOCAL_AMAXES!r} (each rank "
                "keeps its own delayed-scaling histories) or None (the default: the FSDP2 mesh's group, else "
                "every rank when torch.distributed is initialised; docs/running-state.md)."
            )
        self.amax_group = amax_group
        self.fsdp = None
        self.recorded_weight = None

    def group(self):
        """The group that reduces this layer's delayed-scaling amaxes, or None: the group the user
        gave; none for `"local"`; else the FSDP2 mesh's group; else, while torch.distributed is
        initialised with more than one rank, the default group (every rank: DistributedDataParallel,
        as TransformerEngine reduces). Asked at each reduction, so a model quantized before
        `init_process_group` reduces once it is called; a compiled backward asks once, when traced."""
        if self.amax_group is not None:
            return None if isinstance(self.amax_group, str) else self.amax_group  # str: "local"
        if self.fsdp is not None:
            return self.fsdp.mesh_group
        return _default_group()

    def __deepcopy__(self, memo):
        # A copied model is a new layer: same reduction group (groups are not copied), nothing recorded.
        return LayerRunning(self.amax_group)  # FSDP2's hooks tell the copy about its own shard

    def __reduce__(self):
        # A process group cannot be pickled: an unpickled layer takes the default, unless it kept its own histories.
        return LayerRunning, ((LOCAL_AMAXES,) if isinstance(self.amax_group, str) else ())


# `quantize_(..., amax_reduction_group="local")`: no reduction, each rank keeps its own histories.
LOCAL_AMAXES = "local"


def _default_group():
    """The default group while torch.distributed is initialised with more than one rank, else None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.group.WORLD


@dataclass(frozen=True)
class LinearQuantizers:
    """The quantizers of one linear layer, by tensor role; None keeps that tensor in high precision.
    Compares and hashes by value, names aside (torch.compile guards on the one a weight carries)."""

    input: Quantizer | None
    weight: Quantizer | None
    grad_output: Quantizer | None
    backward_override: str | None = None
    # The layer's name and, where it is not `<name>.weight` (nn.MultiheadAttention's
    # `<name>.in_proj_weight`), its parameter's qualified name: for messages only. Left out of
    # equality, so the layers of a model's identical blocks compare equal and torch.compile traces
    # one graph for all of them instead of one per block.
    name: str = field(default="", compare=False)
    parameter: str = field(default="", compare=False)
    # A Hugging Face Conv1D: its module computes `torch.addmm(bias, x, weight)` with the weight kept
    # as [in_features, out_features]. A dynamic weight keeps that layout; a quantized one is held
    # as [out_features, in_features], the layout every GEMM of the layer reads.
    transposed: bool = False
    # fprop on the FP8 tensor cores with their fast accumulation (partial sums kept in the tensor
    # cores' reduced-precision accumulator over all of K); dgrad and wgrad keep the split fp32
    # accumulator unless `backward_fast_accumulation`. Only the FP8 tensor-core GEMMs read them
    # (docs/design.md, The three GEMMs).
    fprop_fast_accumulation: bool = False
    backward_fast_accumulation: bool = False
    running: LayerRunning = field(default_factory=LayerRunning, compare=False, hash=False, repr=False)
    # An expert stack whose quantizers keep running state: each expert's own configuration (its own
    # quantizers, histories and running bookkeeping), which its matrix and its rows are cast with;
    # the stack's roles are the first expert's. Empty otherwise (layers/experts.py).
    experts: tuple = field(default=(), compare=False, hash=False, repr=False)
    # True when a cast of this layer can record an amax (delayed scaling keeps running state): only
    # then do its casts run inside running_state.noting(). Derived once, when the configuration is
    # made: whether a quantizer keeps running state is settled when it is built.
    records_amaxes: bool = field(init=False, compare=False, hash=False, repr=False)

    def __eq__(self, other):
        # As the dataclass's own comparison (the fields with compare=True), answered at once for the
        # same object: torch.compile's guards compare each weight's configuration on every call.
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return _compared(self) == _compared(other)

    def __post_init__(self):
        # The one write a frozen dataclass allows itself: a field derived from the others at construction.
        object.__setattr__(self, "records_amaxes", bool(self.state_buffers()))

    def __setstate__(self, state: dict) -> None:
        # Unpickled (pickle restores the fields without __init__; files written before this field
        # existed lack it): derived again, as at construction.
        self.__dict__.update(state)
        self.__post_init__()

    @property
    def parameter_name(self) -> str:
        return self.parameter or (f"{self.name}.weight" if self.name else "weight")

    def describe(self) -> str:
        parts = [f"{role}={q.describe() if q is not None else 'high precision'}" for role, q in self.roles().items()]
        if self.backward_override:
            parts.append(f"backward={self.backward_override}")
        if self.fprop_fast_accumulation:
            parts.append("fprop fast accumulation")
        if self.backward_fast_accumulation:
            parts.append("backward fast accumulation")
        return ", ".join(parts)

    def layers(self) -> tuple:
        """The configurations whose quantizers cast: each expert's for a stack that has them, else this one."""
        return self.experts or (self,)

    def roles(self) -> dict[str, Quantizer | None]:
        return {"input": self.input, "weight": self.weight, "grad_output": self.grad_output}

    def state_buffers(self) -> dict[str, torch.Tensor]:
        """The quantizers' running state by `<role>.<name>` (delayed scaling's amax histories): the
        live tensors. The weight lists them among its inner tensors (traced_state.py)."""
        return {
            f"{role}.{name}": buffer
            for role, quantizer in self.roles().items()
            if quantizer is not None
            for name, buffer in quantizer.state_buffers().items()
        }

    def move_state(self, device: torch.device) -> None:
        for quantizer in self.roles().values():
            if quantizer is not None:
                quantizer.move_state(device)

    @contextlib.contextmanager
    def using_state(self, buffers: dict[str, torch.Tensor]):
        """Inside, the quantizers run on `buffers` (named as `state_buffers()`) as their state."""
        with contextlib.ExitStack() as stack:
            for role, quantizer in self.roles().items():
                if quantizer is not None:
                    mine = {name.partition(".")[2]: b for name, b in buffers.items() if name.partition(".")[0] == role}
                    stack.enter_context(quantizer.using_state(mine))
            yield


# The compared fields' values as one tuple (element by element, as the dataclass's own comparison).
_compared = operator.attrgetter(*(f.name for f in fields(LinearQuantizers) if f.compare))


def carries_quantizers(tensor) -> bool:
    return getattr(tensor, "linear_quantizers", None) is not None
