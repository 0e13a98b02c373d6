"""Precision schedules: a model's formats changed during training, by step, per role and per layer.

    schedule = qtensor.PrecisionSchedule(model, [
        qtensor.Phase(0, qtensor.recipes.nvfp4()),
        qtensor.Phase(0.85, qtensor.forward_in(qtensor.recipes.mxfp8(), qtensor.recipes.nvfp4())),
    ], total_steps=10_000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    schedule.attach(optimizer)

The schedule quantizes the model with its first phase's recipe (`quantize_`) and advances with
each optimizer step (a step hook on the optimizer it is attached to, or `schedule.step()`). When a
phase begins, each layer whose quantizers the new recipe changes is switched in place:

- a dynamic weight (`weights="dynamic"`) keeps its parameter, values and optimizer state; its layer
  takes the new quantizers, and the next forward casts with them;
- a weight held quantized (`weights="quantized"`) is cast again from its master
  (`qtensor.optim.MasterWeights`, which must be the optimizer attached) in the new format, and the new
  parameter takes the old one's place in the module and in the optimizer;
- a quantizer that compares equal to the one it replaces (same format and configuration) is kept,
  with its running state: delayed scaling's histories carry over where the format stays, and start
  fresh where it changes.

Each switch is reported (`Switch`: step, phase, and per layer and role what changed from what to
what). The schedule's position is its step count: `save_model` records it and `load_model` moves
the model there before loading its weights (which are in that phase's formats); elsewhere
`state_dict()` / `load_state_dict()` save and restore it, loaded before the model's checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .core.numerics import sharded_cast
from .core.quantizer import Quantizer
from .distributed import fsdp_state
from .formats.hybrid import HybridQuantizer
from .formats.identity import IdentityQuantizer
from .layers.config import LinearQuantizers
from .layers.quantized_stack import quantized_stack
from .layers.weight import quantized_weight
from .optim import MasterWeights
from .quantize import _check_no_shared_running_state, quantize_
from .recipes import Recipe


@dataclass(frozen=True)
class Phase:
    """From step `start` on (an int: that optimizer step; a float in [0, 1): that fraction of the
    schedule's `total_steps`, rounded down), the model runs with `recipe` (a Recipe or a factory)."""

    start: int | float
    recipe: Recipe | Callable


class forward_in:
    """A factory whose forward GEMM runs in `forward`'s formats and whose backward GEMMs run in
    `backward`'s (each a factory or Recipe; None: high precision). The input's and the weight's
    rowwise copies (fprop's operands) come from `forward`, their columnwise copies (wgrad's and
    dgrad's) and the output gradient from `backward`; where the two choose the same quantizer, it
    is that quantizer, else a `HybridQuantizer` (`IdentityQuantizer` for a high-precision side:
    the operand's values as they come, fp32 or bf16)."""

    def __init__(self, forward, backward):
        for side, given in (("forward", forward), ("backward", backward)):
            if isinstance(given, Recipe) and (given.backward_override or given.backward_fast_accumulation):
                raise ValueError(
                    f"forward_in: the {side} Recipe's backward options would be lost (a factory has none); give them to "
                    "the phase's Recipe: qtensor.Recipe(qtensor.forward_in(...), backward_fast_accumulation=True)."
                )
        self.forward, self.backward = forward, backward
        self._forward, self._backward = _factory_of(forward), _factory_of(backward)
        # Read by Recipe: the forward's own choice of fast accumulation (a Recipe's, else its factory's).
        self.fprop_fast_accumulation = getattr(forward, "fprop_fast_accumulation", False) if forward is not None else False

    def __call__(self, role):
        back = self._backward(role)
        if role.tensor_type == "grad_output":
            return back
        fwd = self._forward(role)
        if fwd == back:
            return back
        return HybridQuantizer(rowwise=fwd or IdentityQuantizer(), columnwise=back or IdentityQuantizer())

    def __repr__(self) -> str:
        return f"qtensor.forward_in({self.forward!r}, {self.backward!r})"


def _factory_of(recipe_or_factory) -> Callable:
    if recipe_or_factory is None:
        return lambda role: None
    return recipe_or_factory.factory if isinstance(recipe_or_factory, Recipe) else recipe_or_factory


@dataclass
class Switch:
    """One switch of a schedule: at `step`, phase `phase` began; `changes` maps each switched
    layer to its changed roles, each (from, to) as the quantizers describe themselves, and under
    "options" its backward override and fast accumulation where those changed."""

    step: int
    phase: int
    changes: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"step {self.step}: phase {self.phase} begins; {len(self.changes)} layer(s) switched"]
        for layer, roles in self.changes.items():
            for role, (before, after) in roles.items():
                lines.append(f"  {layer:<40} {role:<12} {before} -> {after}")
        return "\n".join(lines)


class PrecisionSchedule:
    """Phases of recipes over a training run (module docstring). `model` is quantized with the
    first phase's recipe; `weights` and the other keyword arguments go to `quantize_` (`exclude=`
    keeps layers in high precision throughout). A model quantized already (`from_pretrained` with
    a `QTensorConfig`) must be in that recipe's formats: the schedule takes its layers as they are.
    A layer the first phase keeps in high precision stays so: a later phase cannot quantize it
    (give it an `IdentityQuantizer` in the first phase to make it a quantized layer that runs in
    high precision until then). Build the optimizer after (quantize_ replaces the parameters) and
    `attach` it."""

    def __init__(self, model: nn.Module, phases, *, total_steps: int | None = None, weights: str = "dynamic", **quantize_kwargs):
        self.model = model
        self.phases = _resolved(phases, total_steps)
        self.total_steps = total_steps
        self.optimizer = None
        self._hook = None
        self.step_count = 0
        self.phase = 0
        self.switches: list[Switch] = []
        self._layers = _quantized_layers(model)
        if self._layers:  # quantized already (from_pretrained with a QTensorConfig): the first phase must be its recipe
            if quantize_kwargs or weights != "dynamic":
                raise ValueError(
                    f"PrecisionSchedule: the model is quantized already; {sorted(quantize_kwargs) or ['weights']} would be "
                    "quantize_'s options, which were settled when it was quantized. Leave them out."
                )
            self.report = getattr(model, "qtensor_report", None)  # (transformers' loader keeps quantize_'s report there)
            self._check_first_phase()
        else:
            self.report = quantize_(model, self.phases[0][1], weights=weights, **quantize_kwargs)
            self._layers = _quantized_layers(model)
        self._check_later_phases()
        _SCHEDULES[model] = self  # (save_model records the position, load_model moves the model to a file's)

    def __repr__(self) -> str:
        phases = ", ".join(f"from step {start}: {recipe!r}" for start, recipe in self.phases)
        return f"PrecisionSchedule(step {self.step_count}, phase {self.phase}; {phases})"

    def phase_at(self, step: int) -> int:
        """The index of the phase that runs step `step` (counted from 0)."""
        return max(index for index, (start, _) in enumerate(self.phases) if start <= step)

    def step(self) -> Switch | None:
        """One optimizer step done: switch the model to the next step's phase where one begins
        (the switch, else None)."""
        return self.go_to_step(self.step_count + 1)

    def go_to_step(self, step: int, *, before_loading: bool = False) -> Switch | None:
        """`step` optimizer steps done (a trainer's global step): the model in that step's phase.
        `before_loading`: a checkpoint's weights are loaded next, over whatever values the switch
        gives held weights, so a held weight without a master is cast from its own values."""
        step = int(step)
        switch = self._go_to(self.phase_at(step), step, before_loading)
        self.step_count = step  # (only once the switch is made: a refused one leaves the position as it was)
        return switch

    def state_dict(self) -> dict:
        return {"step": self.step_count, "phase_starts": [start for start, _ in self.phases]}

    def load_state_dict(self, state: dict, *, before_loading: bool = False) -> Switch | None:
        """Resume at the saved step: the model is switched to that step's phase (load this before
        the model's checkpoint and the optimizer's; `qtensor.load_model` does it for a file that
        `save_model` wrote under a schedule). `before_loading`: as `go_to_step`'s."""
        starts = [start for start, _ in self.phases]
        if list(state["phase_starts"]) != starts:
            raise ValueError(
                f"PrecisionSchedule.load_state_dict: the saved schedule's phases start at steps {state['phase_starts']}, "
                f"this one's at {starts}; resume with the schedule the run was saved with."
            )
        return self.go_to_step(state["step"], before_loading=before_loading)

    @contextlib.contextmanager
    def loading_at(self, state: dict):
        """Inside: the model at the saved position (`load_state_dict`), for a checkpoint saved there
        to load; if the load fails, the layers, their parameters and the position are put back as
        they were (a failed load leaves the model untouched)."""
        layers = {layer: (module, attribute, getattr(module, attribute), module._qtensor_layers[attribute]) for layer, (module, attribute) in self._layers.items()}
        position = (self.step_count, self.phase, len(self.switches))
        self.load_state_dict(state, before_loading=True)
        try:
            yield
        except BaseException:
            for module, attribute, weight, config in layers.values():
                module._qtensor_layers[attribute] = config
                now = getattr(module, attribute)
                if now is not weight:  # a held weight cast again: the parameter it replaced comes back
                    sharded = fsdp_state.fsdp_param_of(module, getattr(now, "_local_tensor", None))
                    self._put_parameter(module, attribute, now, weight, sharded)
                    if sharded is not None:
                        fsdp_state.regather_afresh(sharded)
                getattr(weight, "_local_tensor", weight).linear_quantizers = config[0]
            self.step_count, self.phase = position[:2]
            del self.switches[position[2]:]
            raise

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Advance after each of `optimizer`'s steps. A `MasterWeights` also gives held weights the
        masters they are cast again from at a switch, and takes their new parameters."""
        self.remove()
        self.optimizer = optimizer
        self._hook = optimizer.register_step_post_hook(lambda *args: self.step())

    def remove(self) -> None:
        """Stop following the optimizer's steps."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # ---- switching --------------------------------------------------------------------------
    def _go_to(self, phase: int, step: int, before_loading: bool = False) -> Switch | None:
        if phase == self.phase:
            return None
        planned = self._plan(self.phases[phase][1])
        for layer, module, attribute, new in planned:  # everything checked before anything changes
            self._check_switchable(layer, module, attribute, new, runtime=not before_loading)
        switch = Switch(step, phase)
        for layer, module, attribute, new in planned:
            old = module._qtensor_layers[attribute][0]
            changes = {
                role: (_described(before), _described(after))
                for (role, before), after in zip(old.roles().items(), new.roles().values())
                if before is not after
            }
            if _options(old) != _options(new):
                changes["options"] = (_options(old), _options(new))
            switch.changes[layer] = changes
            self._apply(layer, module, attribute, new)
        self.phase = phase
        self.switches.append(switch)
        return switch

    def _plan(self, recipe: Recipe) -> list:
        """(layer, module, attribute, its configuration under `recipe`) of every layer that changes."""
        planned = [(layer, module, attribute, self._next_config(layer, module, attribute, recipe)) for layer, (module, attribute) in self._layers.items()]
        planned = [entry for entry in planned if entry[3] is not None]
        _check_no_shared_running_state([(None, new) for *_, new in planned])  # (as quantize_ checks a factory)
        return planned

    def _next_config(self, layer, module, attribute, recipe: Recipe) -> LinearQuantizers | None:
        """The layer's configuration under `recipe`, keeping each quantizer that compares equal to
        its successor (and its running state); None where nothing changes."""
        old, _ = module._qtensor_layers[attribute]
        weight = getattr(module, attribute)
        chosen = recipe.quantizers_for("experts" if weight.dim() == 3 else "linear", layer)
        kept = {role: before if before == chosen[role] else chosen[role] for role, before in old.roles().items()}
        new = LinearQuantizers(
            **kept,
            backward_override=recipe.backward_override,
            fprop_fast_accumulation=recipe.fprop_fast_accumulation,
            backward_fast_accumulation=recipe.backward_fast_accumulation,
            name=old.name,
            parameter=old.parameter,
            transposed=old.transposed,
            running=old.running,
            experts=old.experts,
        )
        same_objects = all(new_q is old_q for new_q, old_q in zip(new.roles().values(), old.roles().values()))
        return None if same_objects and new == old else new

    def _check_switchable(self, layer, module, attribute, new: LinearQuantizers, runtime: bool = True) -> None:
        """Refuse (nothing changed yet) a switch qtensor cannot make. `runtime`: the checks that
        depend on the optimizer and the processes too (else only those of the phases' recipes, as
        the schedule makes them when it is built)."""
        old, _ = module._qtensor_layers[attribute]
        weight = getattr(module, attribute)
        if weight.dim() == 3 and (old.experts or any(q is not None and q.state_buffers() for q in new.roles().values())):
            raise NotImplementedError(
                f"PrecisionSchedule: {layer} is an expert stack with delayed scaling (each expert's own histories); switching "
                "such a stack is not supported yet (stacks with stateless scaling switch). Nothing was switched."
            )
        recast = _held(weight) and new.weight is not old.weight
        if recast and new.weight is None:
            raise ValueError(
                f"PrecisionSchedule: {layer} holds its weight quantized, and a phase keeps it in high precision. Give that "
                "role an IdentityQuantizer (the weight held in high precision as a quantized tensor). Nothing was switched."
            )
        if not runtime:
            return
        sharded = hasattr(weight, "_local_tensor")
        if sharded and weight.dim() == 3:
            raise NotImplementedError(
                f"PrecisionSchedule: {layer} is a sharded expert stack; switching its formats is not supported yet "
                "(sharded linear layers switch, under FSDP2 and tensor parallelism). Nothing was switched."
            )
        if recast and not sharded and _several_processes():
            raise NotImplementedError(
                f"PrecisionSchedule: {layer}'s held weight changes format, which makes it a new parameter, and several processes "
                "train (DistributedDataParallel would keep reducing the old one). Switch held weights sharded (FSDP2, tensor parallelism), or keep "
                "the weight role's format across the phases. Nothing was switched."
            )
        if recast and self._master_of(weight) is None:
            raise ValueError(
                f"PrecisionSchedule: {layer}'s weight is held quantized and changes format, which casts it again from its "
                "high-precision master: attach the qtensor.optim.MasterWeights that trains it (a frozen held "
                "weight has no master; casting its dequantized values would round them twice). Nothing was switched."
            )

    def _master_of(self, weight) -> torch.Tensor | None:
        if isinstance(self.optimizer, MasterWeights):
            return next((master for param, master in self.optimizer.pairs if param is weight), None)
        return None

    def _apply(self, layer, module, attribute, new: LinearQuantizers) -> None:
        old, weights = module._qtensor_layers[attribute]
        weight = getattr(module, attribute)
        module._qtensor_layers[attribute] = (new, weights)
        local = getattr(weight, "_local_tensor", weight)  # a sharded layer's (FSDP2, tensor parallelism): its shard
        fsdp_param = fsdp_state.fsdp_param_of(module, local) if local is not weight else None
        if _held(weight) and new.weight is not old.weight:
            self._recast(module, attribute, weight, new, fsdp_param)
        else:  # the same parameter: its next casts use the new quantizers
            local.linear_quantizers = new
            for cached in ("shard_cast", "reduced_amaxes", "rowwise_cast_suffices"):  # a sharded dynamic weight's last casts
                local.__dict__.pop(cached, None)
        if fsdp_param is not None:
            fsdp_state.regather_afresh(fsdp_param)  # FSDP2 gathers the new format at its sizes

    def _recast(self, module, attribute, weight, new: LinearQuantizers, fsdp_param) -> None:
        """A held weight in `new`'s format, in place of `weight` in the module and the optimizer: cast
        as MasterWeights' write-back casts, from the master (a sharded weight from the master's
        shard, at the whole tensor's scales), or before a checkpoint's load, where there is no master
        yet, from the weight's own values, which the load replaces."""
        local = getattr(weight, "_local_tensor", weight)
        master = self._master_of(weight)
        source = getattr(master, "_local_tensor", master).detach() if master is not None else local.dequantize()
        mesh = getattr(weight, "device_mesh", None)
        groups = fsdp_state.placement_groups(mesh, weight.placements) if mesh is not None else ()
        with torch.no_grad(), sharded_cast(groups, owner="a precision schedule's switch"):
            if weight.dim() == 3:  # an expert stack: each expert's matrix in the new format
                # (made in the stack's dtype, then each expert cast from the fp32 values as write-back casts)
                held = quantized_stack(source.to(local.dtype), new)
                held.copy_(source)
            else:
                cast = new.weight.quantize(source, rowwise=True, columnwise=True)
                held = quantized_weight(cast.with_storages(cast.rowwise, cast.columnwise, dtype=local.dtype), new)
        if mesh is not None:
            from torch.distributed.tensor import DTensor

            held = DTensor.from_local(held, mesh, weight.placements, run_check=False, shape=weight.shape, stride=weight.stride())
        weight._qtensor_replaced = f"{new.parameter_name} (by a precision schedule's switch)"
        self._put_parameter(module, attribute, weight, nn.Parameter(held, requires_grad=weight.requires_grad), fsdp_param)

    def _put_parameter(self, module, attribute, old: nn.Parameter, new: nn.Parameter, fsdp_param) -> None:
        """`new` in place of `old`: in the module, in FSDP2 (which pads its shard as at sharding)
        and in the MasterWeights that trains it."""
        setattr(module, attribute, new)
        if fsdp_param is not None:
            fsdp_param.reset_sharded_param()
        if isinstance(self.optimizer, MasterWeights) and any(param is old for param, _ in self.optimizer.pairs):
            self.optimizer.replace_parameter(old, new)

    def _check_first_phase(self) -> None:
        """A model quantized before the schedule was made: its layers must be what the first phase's
        recipe makes (layers it left in high precision stay so)."""
        recipe = self.phases[0][1]
        differ = [layer for layer, (module, attribute) in self._layers.items() if self._next_config(layer, module, attribute, recipe) is not None]
        if differ:
            raise ValueError(
                f"PrecisionSchedule: the model is quantized already, and {differ[:3]} differ from what the first phase's recipe "
                f"({recipe!r}) makes. Give the schedule the recipe the model was quantized with as its first phase."
            )

    def _check_later_phases(self) -> None:
        """When the schedule is made: each later phase's recipe is one quantize_ would take for these
        layers (its backward override with its quantizers, no delayed-scaling quantizer shared between
        layers, no layer's switch refused for its recipe alone), and a layer the first phase's factory
        keeps in high precision stays so (class docstring; where the report tells such layers)."""
        skipped = self.report.skipped if self.report is not None else {}
        kept = [layer for layer, reason in skipped.items() if reason.startswith("the factory keeps every tensor")]
        for index, (start, recipe) in enumerate(self.phases[1:], start=1):
            for layer, module, attribute, new in self._plan(recipe):
                self._check_switchable(layer, module, attribute, new, runtime=False)
            for layer in kept:
                if any(q is not None for q in recipe.quantizers_for("linear", layer).values()):
                    raise ValueError(
                        f"PrecisionSchedule: phase {index} (from step {start}) quantizes {layer}, which the first phase keeps in "
                        "high precision. A layer's participation is settled by the first phase: give that layer an "
                        "IdentityQuantizer there (a quantized layer running in high precision), or keep it out with exclude=."
                    )


# Each model's schedule (the last made for it), for save_model and load_model.
_SCHEDULES: "weakref.WeakKeyDictionary[nn.Module, PrecisionSchedule]" = weakref.WeakKeyDictionary()


def schedule_of(model: nn.Module) -> PrecisionSchedule | None:
    """The precision schedule made for `model`, if any."""
    return _SCHEDULES.get(model)


def _held(weight) -> bool:
    """Whether `weight` (a layer weight, or a DTensor over one) holds its values quantized."""
    return not getattr(getattr(weight, "_local_tensor", weight), "quantized_at_use", True)


def _several_processes() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _resolved(phases, total_steps: int | None) -> list[tuple[int, Recipe]]:
    """[(start step, Recipe)], checked: the first starting at 0, strictly increasing."""
    resolved = []
    for phase in phases:
        start, recipe = (phase.start, phase.recipe) if isinstance(phase, Phase) else phase
        if isinstance(start, float):
            if total_steps is None or not 0.0 <= start < 1.0:
                raise ValueError(
                    f"PrecisionSchedule: phase start {start} is a fraction of the run: it must lie in [0, 1) and the "
                    "schedule needs total_steps= (or give the start as a step number, an int)."
                )
            start = math.floor(start * total_steps)
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"PrecisionSchedule: phase start {start!r} must be a step number (an int >= 0) or a fraction in [0, 1).")
        resolved.append((start, recipe if isinstance(recipe, Recipe) else Recipe(recipe)))
    starts = [start for start, _ in resolved]
    if not resolved or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"PrecisionSchedule: phases must start at step 0 and then at increasing steps; they start at {starts}.")
    return resolved


def _quantized_layers(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Each quantized layer of `model` by its name: (module, weight attribute)."""
    layers = {}
    for module in model.modules():
        for attribute, (linear, _) in (module.__dict__.get("_qtensor_layers") or {}).items():
            layers[linear.name or attribute] = (module, attribute)
    return layers


def _described(quantizer: Quantizer | None) -> str:
    return "high precision" if quantizer is None else quantizer.describe()


def _options(linear: LinearQuantizers) -> str:
    """The layer's backward override and accumulation choices, as a switch reports them."""
    return ", ".join(
        [f"backward={linear.backward_override or 'quantized'}"]
        + [f"{gemm} fast accumulation" for gemm, on in (("fprop", linear.fprop_fast_accumulation), ("backward", linear.backward_fast_accumulation)) if on]
    )
