"""MasterWeights: train quantized parameters through high-precision master copies."""

from __future__ import annotations

import collections
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .distributed.fsdp_state import placement_groups
from .core.numerics import sharded_cast
from .core.tensor import QuantizedTensor


def is_quantized(param: torch.Tensor) -> bool:
    """A QuantizedTensor or an expert stack held quantized, or a sharded (DTensor) parameter whose
    local shard is one."""
    local = getattr(param, "_local_tensor", param)
    return isinstance(local, QuantizedTensor) or getattr(local, "quantized_at_use", True) is False


def _master_of(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The high-precision master of a quantized parameter, sharded like it when it is a DTensor."""
    local = getattr(param, "_local_tensor", None)
    if local is None:
        return param.dequantize(dtype).detach()
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.dequantize(dtype), param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    ).detach()


class MasterWeights(torch.optim.Optimizer):
    """A torch optimizer over a model's parameters, with high-precision masters for the quantized ones.

    For each parameter that is a QuantizedTensor, a master copy in `master_dtype` takes its place in
    the wrapped optimizer. `step()` steps the wrapped optimizer and writes the masters back into the
    quantized parameters with `copy_` (a requantization). Plain parameters pass through untouched.

    It is a `torch.optim.Optimizer`: `param_groups`, `state` and `defaults` are the wrapped
    optimizer's own objects, so LR schedulers, `torch.amp.GradScaler` and `zero_grad` take it
    directly. Each quantized parameter's gradient reaches its master as soon as it is accumulated
    (a post-accumulate-grad hook on the parameter; under FSDP2, after the reduce-scatter): the same
    tensor where the dtypes agree, so what a GradScaler unscales and what gradient clipping scales
    is what the step uses.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, master_dtype: torch.dtype = torch.float32):
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, MasterWeights):
            raise TypeError(
                f"MasterWeights wraps a torch optimizer built over the model's parameters, got {type(optimizer).__name__}: "
                "qtensor.optim.MasterWeights(torch.optim.AdamW(model.parameters(), lr=...))."
            )
        if any(optimizer.state.values()):
            raise ValueError(
                "MasterWeights must wrap an optimizer that has not stepped yet (its state belongs to "
                "the quantized parameters, not to the masters). Wrap it right after building it."
            )
        # Not torch.optim.Optimizer.__init__: groups, state and defaults stay the wrapped optimizer's.
        self.optimizer = optimizer
        self.master_dtype = master_dtype
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copies: dict[int, tuple] = {}  # id(master) → what _hand_over copied (dtypes differ)
        self._hooks = []
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()
        for group in optimizer.param_groups:
            self._take_masters(group)

    def _take_masters(self, group: dict) -> None:
        for index, param in enumerate(group["params"]):
            if is_quantized(param):
                master = _master_of(param, self.master_dtype).requires_grad_(param.requires_grad)
                group["params"][index] = master
                self.pairs.append((param, master))
                if param.requires_grad:
                    self._hooks.append(param.register_post_accumulate_grad_hook(_hand_over_hook(self, len(self.pairs) - 1)))

    def hand_over_gradients(self) -> None:
        """Give each master its parameter's gradient (what the parameters' hooks do as gradients
        are accumulated)."""
        for index in range(len(self.pairs)):
            self.hand_over(index)

    @torch.no_grad()
    def hand_over(self, index: int) -> None:
        """Give master `index` its parameter's gradient: the same tensor where the dtypes agree (so
        unscaling or clipping either is seen by both), else a copy in master_dtype."""
        param, master = self.pairs[index]
        grad = param.grad
        if grad is None or master.grad is grad:
            return
        if grad.dtype == master.dtype:
            master.grad = grad
        else:
            master.grad = grad.detach().to(self.master_dtype)
            self._copies[id(master)] = (grad, grad._version, master.grad, master.grad._version)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)
        self._take_masters(self.optimizer.param_groups[-1])

    def replace_parameter(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Let quantized parameter `new` take `old`'s place, with `old`'s master and its optimizer
        state (a precision schedule's switch casts a held weight again in another format)."""
        for index, (param, master) in enumerate(self.pairs):
            if param is old:
                self.pairs[index] = (new, master)
                if new.requires_grad:
                    self._hooks.append(new.register_post_accumulate_grad_hook(_hand_over_hook(self, index)))
                return
        raise KeyError("MasterWeights.replace_parameter: the parameter to replace is not one of this optimizer's quantized parameters.")

    def masters(self) -> list[torch.Tensor]:
        return [master for _, master in self.pairs]

    def step(self, closure=None):
        """One step of the wrapped optimizer on the masters, then the masters written back.

        A `closure` (LBFGS and friends) is evaluated at the masters: each call first writes them
        into the quantized parameters, and its gradients reach the masters after it.
        """
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        if closure is None:
            self._gradients_to_masters()
            loss = self.optimizer.step()
        else:

            def closure_for_masters():
                # The model runs on the quantized parameters: bring them to the masters the
                # optimizer is evaluating, then hand the gradients back.
                self.write_back()
                loss = closure()
                self._gradients_to_masters()
                return loss

            loss = self.optimizer.step(closure_for_masters)
        self.write_back()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    @torch.no_grad()
    def _gradients_to_masters(self) -> None:
        """Gradients set without a backward (or changed after it) reach the masters here."""
        for param, master in self.pairs:
            grad = param.grad
            if grad is None or master.grad is grad:
                master.grad = grad
                continue
            copied = self._copies.get(id(master))
            if copied is not None and copied[2] is master.grad:
                param_changed = copied[0] is not grad or grad._version != copied[1]
                master_changed = master.grad._version != copied[3]
                if not param_changed:
                    continue  # the master holds this gradient, unscaled by a GradScaler or not
                if master_changed:
                    raise ValueError(
                        "MasterWeights: after backward both a quantized parameter's gradient and its master's "
                        "changed (a GradScaler unscaled the masters and clip_grad_norm_ scaled model.parameters()?). "
                        f"With master_dtype={self.master_dtype} and {grad.dtype} parameters they are separate tensors: "
                        "clip the optimizer's parameters instead, "
                        "clip_grad_norm_([p for group in optimizer.param_groups for p in group['params']], ...)."
                    )
            master.grad = grad.to(self.master_dtype)
        self._copies.clear()

    @torch.no_grad()
    def write_back(self) -> None:
        """Requantize every master into its quantized parameter. A sharded parameter's shards are
        quantized with one tensor-wide scale: the amax is reduced over every mesh dimension that
        splits it (docs/design.md, FSDP2)."""
        for param, master in self.pairs:
            mesh = getattr(param, "device_mesh", None)
            groups = placement_groups(mesh, param.placements) if mesh is not None else ()
            with sharded_cast(groups, owner="MasterWeights.write_back"):
                param.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for param, _ in self.pairs:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()
        self._copies.clear()

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [master.detach().clone() for master in self.masters()],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the wrapped optimizer's state and the masters, and write the masters back into the
        quantized parameters. That write is a cast: under delayed scaling it takes the history's
        scale and records an amax. To resume exactly, load this first and the model's checkpoint
        (`qtensor.load_model`, which restores the weights' bytes and histories) after it."""
        masters = state_dict["masters"]
        if len(masters) != len(self.pairs):
            raise ValueError(f"MasterWeights state holds {len(masters)} masters; this optimizer has {len(self.pairs)}.")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for (_, master), saved in zip(self.pairs, masters):
                master.copy_(saved)
        self.write_back()

    def __getstate__(self) -> dict:
        raise TypeError("MasterWeights cannot be pickled; save master_weights.state_dict() instead.")

    def __repr__(self) -> str:
        return f"MasterWeights({self.optimizer!r}, master_dtype={self.master_dtype}, masters={len(self.pairs)})"


def _hand_over_hook(master_weights: MasterWeights, index: int):
    """A post-accumulate-grad hook for parameter `index` (a weak reference: the parameter does not
    keep its optimizer alive)."""
    owner = weakref.ref(master_weights)

    def hand_over(param):
        alive = owner()
        if alive is not None:
            alive.hand_over(index)

    return hand_over


def _check_optimizer_parameters(optimizer, args, kwargs) -> None:
    """Runs before every torch optimizer step (registered once, globally, by `import qtensor`).

    A torch optimizer stepping a quantized parameter directly creates its state with zeros_like (quantized
    too) and requantizes every update: training diverges without a word. One holding a parameter that
    quantize_ replaced trains nothing. Both raise here, at the first step, naming the parameter."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            replaced = param.__dict__.get("_qtensor_replaced")
            if replaced is not None:
                raise ValueError(
                    f"{type(optimizer).__name__} holds {replaced} as it was before qtensor replaced it, so it "
                    "trains nothing. Build the optimizer after qtensor.quantize_(model, ...)."
                )
            if is_quantized(param):
                linear = getattr(param, "linear_quantizers", None) or getattr(getattr(param, "_local_tensor", None), "linear_quantizers", None)
                name = linear.parameter_name if linear is not None else f"a {type(param).__name__} parameter"
                raise TypeError(
                    f"{type(optimizer).__name__} is stepping {name}, a quantized parameter (weights='quantized'), "
                    "directly: its state and updates would be quantized. Wrap the optimizer: "
                    "qtensor.optim.MasterWeights(torch.optim.AdamW(model.parameters(), ...))."
                )


register_optimizer_step_pre_hook(_check_optimizer_parameters)
