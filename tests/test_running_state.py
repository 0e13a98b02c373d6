"""Delayed scaling's running state (amax histories) follows one rule: a training step records, an
evaluation or inference forward records nothing.

Each test runs stock models through `quantize_(model, recipes.float8_delayed(), weights=...)` and
checks the histories against an independent reference: the same training without the evaluation
forwards (or without activation checkpointing), or the amaxes of the tensors themselves, computed
here in fp32 from what the layers received.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import qtensor
from qtensor.formats.float8 import UNRECORDED

WEIGHTS = ["dynamic", "quantized"]
ROLES = ("input", "weight", "grad_output")
STEPS = 3


def mlp(weights: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    qtensor.quantize_(model, qtensor.recipes.float8_delayed(), weights=weights)
    return model


def optimizer_for(model: nn.Module, weights: str) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return qtensor.optim.MasterWeights(optimizer) if weights == "quantized" else optimizer


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def quantizer_of(layer: nn.Linear, role: str):
    """The quantizer whose history records `role`'s casts: a quantized weight's own quantizer
    (what requantizes it), else the one of the layer's quantizers for that role."""
    if role == "weight" and isinstance(layer.weight, qtensor.QuantizedTensor):
        return layer.weight.quantizer
    return getattr(layer.weight.linear_quantizers, role)


def histories(model: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    """A copy of every amax history, by (layer, role)."""
    return {
        (name, role): quantizer_of(layer, role).amax_history.detach().clone()
        for name, layer in linear_layers(model).items()
        for role in ROLES
    }


def recorded(history: torch.Tensor) -> int:
    return int((history != UNRECORDED).sum())


def assert_same_histories(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"{key}: the history changed"


def values(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter's values as a plain fp32 tensor (a quantized one dequantized)."""
    if isinstance(parameter, qtensor.QuantizedTensor):
        return parameter.dequantize(torch.float32)
    if isinstance(parameter, qtensor.DynamicWeight):
        return parameter.plain().detach().float().clone()
    return parameter.detach().float().clone()


def batches(n: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 64, generator=generator), torch.randn(16, 32, generator=generator)) for _ in range(n)]


PROBE = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))


def train_step(model: nn.Module, optimizer, x: torch.Tensor, target: torch.Tensor) -> float:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def evaluate_no_grad_eval_mode(model, x):
    model.eval()
    try:
        with torch.no_grad():
            return model(x)
    finally:
        model.train()


def evaluate_no_grad(model, x):
    with torch.no_grad():
        return model(x)


def evaluate_inference_mode(model, x):
    with torch.inference_mode():
        return model(x).clone()


EVALUATIONS = {
    "no_grad in eval mode": evaluate_no_grad_eval_mode,
    "no_grad in train mode": evaluate_no_grad,
    "inference_mode": evaluate_inference_mode,
}


# ---- 1. evaluation and inference forwards record nothing -----------------------------------------
@pytest.mark.parametrize("trained_steps", [0, STEPS], ids=["before training", "after training"])
@pytest.mark.parametrize("evaluation", EVALUATIONS)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_an_evaluation_forward_leaves_every_history_unchanged_and_repeats_bitwise(weights, evaluation, trained_steps):
    model = mlp(weights)
    optimizer = optimizer_for(model, weights)
    for x, target in batches(trained_steps):
        train_step(model, optimizer, x, target)
    before = histories(model)
    if trained_steps:
        assert any(recorded(h) for h in before.values()), "training recorded nothing: the test would prove nothing"
    first = EVALUATIONS[evaluation](model, PROBE)
    assert_same_histories(histories(model), before)
    second = EVALUATIONS[evaluation](model, PROBE)
    assert_same_histories(histories(model), before)
    assert torch.equal(first, second)


# ---- 2. evaluating between training steps changes nothing ---------------------------------------
def train(weights: str, evaluate_between: bool) -> dict:
    model = mlp(weights)
    optimizer = optimizer_for(model, weights)
    losses = []
    for x, target in batches(STEPS):
        if evaluate_between:
            with torch.no_grad():
                model(PROBE)
        losses.append(train_step(model, optimizer, x, target))
    with torch.no_grad():
        probe = model(PROBE)
    return {
        "losses": losses,
        "parameters": {name: values(p) for name, p in model.named_parameters()},
        "histories": histories(model),
        "probe": probe,
    }


@pytest.mark.parametrize("weights", WEIGHTS)
def test_evaluating_between_training_steps_changes_no_step(weights):
    plain = train(weights, evaluate_between=False)
    evaluated = train(weights, evaluate_between=True)
    assert evaluated["losses"] == plain["losses"]
    assert evaluated["parameters"].keys() == plain["parameters"].keys()
    for name, expected in plain["parameters"].items():
        assert torch.equal(evaluated["parameters"][name], expected), name
    assert_same_histories(evaluated["histories"], plain["histories"])
    assert torch.equal(evaluated["probe"], plain["probe"])


# ---- 3. a training step records ------------------------------------------------------------------
def capture_layer_tensors(model: nn.Module) -> dict[str, dict[str, list]]:
    """Per layer: the inputs its forwards received and the gradients its outputs received."""
    seen = {name: {"input": [], "grad_output": []} for name in linear_layers(model)}
    for name, layer in linear_layers(model).items():
        layer.register_forward_pre_hook(lambda module, args, _name=name: seen[_name]["input"].append(args[0].detach().clone()))

        def keep_grad(module, args, output, _name=name):
            if output.requires_grad:
                output.register_hook(lambda grad: seen[_name]["grad_output"].append(grad.detach().clone()))

        layer.register_forward_hook(keep_grad)
    return seen


def amax(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float().abs().max()


@pytest.mark.parametrize("weights", WEIGHTS)
def test_a_training_step_records_one_amax_per_history_and_the_input_amax_is_max_abs_input(weights):
    model = mlp(weights)
    optimizer = optimizer_for(model, weights)
    seen = capture_layer_tensors(model)
    for step, (x, target) in enumerate(batches(STEPS)):
        before = histories(model)
        weights_before = {name: values(layer.weight) for name, layer in linear_layers(model).items()}
        for kept in seen.values():
            kept["input"].clear()
            kept["grad_output"].clear()
        train_step(model, optimizer, x, target)
        after = histories(model)
        for key in before:
            assert recorded(after[key]) == recorded(before[key]) + 1, (step, key)
            assert torch.isfinite(after[key][-1]) and after[key][-1] >= 0, (step, key)
        for name in linear_layers(model):
            (layer_input,) = seen[name]["input"]
            (grad_output,) = seen[name]["grad_output"]
            assert after[(name, "input")][-1] == amax(layer_input), (step, name)
            assert after[(name, "grad_output")][-1] == amax(grad_output), (step, name)
            if weights == "dynamic":  # cast in the forward, from the values the step started with
                assert after[(name, "weight")][-1] == amax(weights_before[name]), (step, name)


# ---- 4. gradient accumulation --------------------------------------------------------------------
@pytest.mark.parametrize("weights", WEIGHTS)
def test_gradient_accumulation_records_the_weight_once_per_optimizer_step_and_activations_per_micro_batch(weights):
    model = mlp(weights)
    optimizer = optimizer_for(model, weights)
    micro_batches = batches(2 * STEPS)
    for step in range(STEPS):
        before = histories(model)
        for x, target in micro_batches[2 * step: 2 * step + 2]:
            (F.mse_loss(model(x), target) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        after = histories(model)
        for (name, role), history in after.items():
            new_entries = recorded(history) - recorded(before[(name, role)])
            assert new_entries == (1 if role == "weight" else 2), (step, name, role, new_entries)


# ---- 5. activation checkpointing -----------------------------------------------------------------
class CheckpointedNet(nn.Module):
    """A linear, a block (GELU, linear, GELU, linear) recomputed in the backward or not, a head."""

    def __init__(self, use_reentrant: bool | None):
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.block = nn.Sequential(nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        self.head = nn.Linear(64, 32)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = self.first(x)
        if self.use_reentrant is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.use_reentrant)
        return self.head(F.gelu(h))


def train_checkpointed(weights: str, use_reentrant: bool | None) -> list[dict]:
    torch.manual_seed(0)
    model = CheckpointedNet(use_reentrant)
    qtensor.quantize_(model, qtensor.recipes.float8_delayed(), weights=weights)
    optimizer = optimizer_for(model, weights)
    steps = []
    for x, target in batches(STEPS):
        loss = F.mse_loss(model(x), target)
        loss.backward()
        grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        steps.append({"loss": loss.item(), "grads": grads, "histories": histories(model)})
    return steps


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_activation_checkpointing_gives_the_gradients_and_histories_of_no_checkpointing(weights, use_reentrant):
    expected = train_checkpointed(weights, use_reentrant=None)
    actual = train_checkpointed(weights, use_reentrant=use_reentrant)
    assert any(recorded(h) for h in expected[-1]["histories"].values())
    for step, (mine, theirs) in enumerate(zip(actual, expected)):
        assert mine["loss"] == theirs["loss"], step
        assert mine["grads"].keys() == theirs["grads"].keys()
        for name, grad in theirs["grads"].items():
            assert torch.equal(mine["grads"][name], grad), (step, name)
        assert_same_histories(mine["histories"], theirs["histories"])


TRACED_REDUCTION = """
import os, tempfile
import torch, torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from qtensor.core import running_state

dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0, world_size=1)
def refused(*args, **kwargs):
    raise AssertionError("dist.all_reduce was called on a traced tensor")
dist.all_reduce = refused
with FakeTensorMode():  # what AOTAutograd's trace of a compiled backward hands it
    reduced = running_state._all_reduce_max(torch.ones(3), dist.group.WORLD)
print(type(reduced).__name__, tuple(reduced.shape))
os._exit(0)
"""


def test_amaxes_reduced_while_a_backward_is_traced_go_through_the_functional_collective():
    """AOTAutograd traces a compiled backward on fake or functional tensors with
    torch.compiler.is_compiling() False: the reduction of the step's amaxes must still be the
    functional collective, named by its group (the in-place one puts a ProcessGroup object in the
    graph, which inductor's copy of the backward cannot copy on NCCL)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TRACED_REDUCTION], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(3,)" in done.stdout, done.stdout
