"""MasterWeights: train quantized parameters through high-precision master copies."""

from __future__ import annotations

import contextlib

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .numerics import reduce_amax_over
from .tensor import QuantizedTensor


def is_quantized(param: torch.Tensor) -> bool:
    """A QuantizedTensor, or a sharded (DTensor) parameter whose local shard is one."""
    return isinstance(param, QuantizedTensor) or isinstance(getattr(param, "_local_tensor", None), QuantizedTensor)


def _master_of(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The high-precision master of a quantized parameter, sharded like it when it is a DTensor."""
    local = getattr(param, "_local_tensor", None)
    if local is None:
        return param.dequantize(dtype).detach()
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.dequantize(dtype), param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    ).detach()


class MasterWeights:
    """Wraps a torch optimizer built over a model's parameters.

    For each parameter that is a QuantizedTensor, a master copy in `master_dtype` takes its place in
    the wrapped optimizer. `step()` hands the parameters' gradients to the masters, steps, and writes
    the masters back into the quantized parameters with `copy_` (a requantization). Plain parameters
    pass through untouched. Learning-rate schedulers take the wrapped optimizer
    (`StepLR(master_weights.optimizer, ...)`): the parameter groups are the same.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, master_dtype: torch.dtype = torch.float32):
        if any(optimizer.state.values()):
            raise ValueError(
                "MasterWeights must wrap an optimizer that has not stepped yet (its state belongs to "
                "the quantized parameters, not to the masters). Wrap it right after building it."
            )
        self.optimizer = optimizer
        self.master_dtype = master_dtype
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in optimizer.param_groups:
            for index, param in enumerate(group["params"]):
                if is_quantized(param):
                    master = _master_of(param, master_dtype).requires_grad_(param.requires_grad)
                    group["params"][index] = master
                    self.pairs.append((param, master))

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def masters(self) -> list[torch.Tensor]:
        return [master for _, master in self.pairs]

    def step(self, closure=None):
        """One step of the wrapped optimizer on the masters, then the masters written back.

        A `closure` (LBFGS and friends) is evaluated at the masters: each call first writes them
        into the quantized parameters, and its gradients reach the masters after it.
        """
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
        return loss

    @torch.no_grad()
    def _gradients_to_masters(self) -> None:
        for param, master in self.pairs:
            master.grad = None if param.grad is None else param.grad.to(self.master_dtype)

    @torch.no_grad()
    def write_back(self) -> None:
        """Requantize every master into its quantized parameter. A sharded parameter's shards are
        quantized with one tensor-wide scale: the amax is reduced over its mesh (DESIGN.md §4)."""
        for param, master in self.pairs:
            mesh = getattr(param, "device_mesh", None)
            with reduce_amax_over(mesh.get_group()) if mesh is not None else contextlib.nullcontext():
                param.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for param, _ in self.pairs:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [master.detach().clone() for master in self.masters()],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        masters = state_dict["masters"]
        if len(masters) != len(self.pairs):
            raise ValueError(f"MasterWeights state holds {len(masters)} masters; this optimizer has {len(self.pairs)}.")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for (_, master), saved in zip(self.pairs, masters):
                master.copy_(saved)
        self.write_back()

    def __repr__(self) -> str:
        return f"MasterWeights({self.optimizer!r}, master_dtype={self.master_dtype}, masters={len(self.pairs)})"


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
