"""Precision schedules (qtensor/schedule.py): a model's formats changed during training.

The references are independent of the schedule: the formats read back from the layers' own casts,
a run that changes the recipe by hand at the switch (a fresh model quantize_'d with the next
recipe, loaded with the first model's values and optimizer state), the uninterrupted run for a
resumed one, fp64 products for a forward kept in high precision.
"""


from unittest import mock

import numpy as np
import pytest
import torch
import torch._dynamo.testing
from torch import nn

import qtensor
from qtensor.optim import MasterWeights

STEPS, SWITCH = 6, 3


def mlp(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32)).to(device)


def batch(step, device="cpu"):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 64, generator=generator).to(device), torch.randn(16, 32, generator=generator).to(device)


def train(model, optimizer, steps, start=0):
    losses = []
    device = next(model.parameters()).device
    for step in range(start, start + steps):
        torch.manual_seed(1000 + step)  # stochastic rounding draws from torch's generator: alike in the runs compared
        x, target = batch(step, device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = (model(x).float() - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def values(model):
    """Every parameter's high-precision values (a held weight dequantized)."""
    return [p.dequantize(torch.float32) if isinstance(p, qtensor.QuantizedTensor) else p.detach().float().clone() for p in model.parameters()]


def formats(model):
    """(rowwise format, columnwise format) of each layer's weight as its own cast makes them, and the
    input's and gradient's quantizer classes."""
    found = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            weight = module.weight
            cast = weight.quantized(columnwise=True) if weight.quantized_at_use else weight
            linear = weight.linear_quantizers
            cast_format = getattr(type(cast), "data_class", type(cast)).__name__  # a held weight's: its format's class
            found.append((cast_format, type(linear.input).__name__, type(linear.grad_output).__name__))
    return found


def two_phases(second=None):
    return [qtensor.Phase(0, qtensor.recipes.float8_current()), qtensor.Phase(SWITCH, second or qtensor.recipes.mxfp8())]


def test_a_schedule_switches_at_its_steps_and_reports_each_switch():
    """Phases by step and by fraction of the run: the layers' casts are in each phase's format from
    the step the phase begins (read back after every optimizer step), and each switch names the
    layers and roles that changed, from what to what."""
    model = mlp()
    schedule = qtensor.PrecisionSchedule(model, [
        qtensor.Phase(0, qtensor.recipes.float8_current()),
        qtensor.Phase(2, qtensor.recipes.mxfp8()),
        qtensor.Phase(0.5, qtensor.recipes.nvfp4()),  # step 4 of 8
    ], total_steps=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule.attach(optimizer)
    expected = {0: "Float8Tensor", 1: "Float8Tensor", 2: "MXFP8Tensor", 3: "MXFP8Tensor", 4: "NVFP4Tensor", 5: "NVFP4Tensor"}
    for step in range(6):
        assert [f[0] for f in formats(model)] == [expected[step]] * 2, step
        train(model, optimizer, 1, start=step)
    assert [(s.step, s.phase) for s in schedule.switches] == [(2, 1), (4, 2)]
    first = schedule.switches[0]
    assert set(first.changes) == {"0", "2"}
    assert first.changes["0"]["weight"] == (qtensor.Float8Quantizer().describe(), qtensor.MXFP8Quantizer().describe())
    assert first.changes["0"]["options"] == ("backward=quantized, fprop fast accumulation", "backward=quantized")
    assert "phase 1 begins; 2 layer(s) switched" in str(first)


LATE_MXFP8 = qtensor.forward_in(qtensor.recipes.mxfp8(), qtensor.recipes.nvfp4())
PAIRS = {  # (first recipe, then, the format of the weight's forward copy after the switch)
    "float8_current to mxfp8": (qtensor.recipes.float8_current(), qtensor.recipes.mxfp8(), "MXFP8Tensor"),
    "nvfp4 to an mxfp8 forward": (qtensor.recipes.nvfp4(), LATE_MXFP8, "HybridQuantizedTensor"),
}
ON_DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_a_switch_equals_changing_the_recipe_by_hand(weights, pair, device):
    """One recipe, then another from step 3 (float8_current then mxfp8; NVFP4 then its forward in
    MXFP8, the study's late switch): the schedule's run ends bit for bit where a run ends that stops
    at step 3, builds a fresh model with the second recipe, loads the first model's values and
    optimizer state into it, and goes on. The optimizer keeps its state across the switch (the
    same parameters, or for held weights the same masters). On the CPU and on a GPU (its kernels)."""
    first_recipe, then_recipe, then_format = PAIRS[pair]
    model = mlp(device=device)
    schedule = qtensor.PrecisionSchedule(model, [qtensor.Phase(0, first_recipe), qtensor.Phase(SWITCH, then_recipe)], weights=weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer = MasterWeights(optimizer) if weights == "quantized" else optimizer
    schedule.attach(optimizer)
    losses = train(model, optimizer, STEPS)

    first = mlp(device=device)
    qtensor.quantize_(first, first_recipe, weights=weights)
    by_hand = torch.optim.AdamW(first.parameters(), lr=1e-2)
    by_hand = MasterWeights(by_hand) if weights == "quantized" else by_hand
    hand_losses = train(first, by_hand, SWITCH)
    second = mlp(device=device)
    qtensor.quantize_(second, then_recipe, weights=weights)
    continued = torch.optim.AdamW(second.parameters(), lr=1e-2)
    continued = MasterWeights(continued) if weights == "quantized" else continued
    with torch.no_grad():  # the plain parameters' values, and a dynamic weight's
        for theirs, ours in zip(first.parameters(), second.parameters()):
            if not isinstance(ours, qtensor.QuantizedTensor):
                ours.copy_(theirs)
    continued.load_state_dict(by_hand.state_dict())  # and for held weights the masters, cast into them
    hand_losses += train(second, continued, STEPS - SWITCH, start=SWITCH)

    assert losses == hand_losses
    for ours, theirs in zip(values(model), values(second), strict=True):
        assert torch.equal(ours, theirs)
    assert [f[0] for f in formats(model)] == [then_format] * 2


@pytest.mark.parametrize("checkpoint", ["save_model", "dcp"])
@pytest.mark.parametrize("saved_at", [2, 4], ids=["before the switch", "after the switch"])
@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_resuming_ends_bit_for_bit_where_the_uninterrupted_run_ends(tmp_path, weights, saved_at, checkpoint):
    """Save at step 2 (the resumed run crosses the switch at 3) or 4 (it resumes in the second
    phase): the schedule's state, the model's and the optimizer's, loaded into a fresh model in that
    order (a qtensor.save_model file, which records the schedule's position and moves it there as
    it loads, beside the optimizer's state; or one torch.distributed.checkpoint read twice, the
    schedule's entry first), continue to the uninterrupted run's last values and losses."""
    def start():
        model = mlp()
        schedule = qtensor.PrecisionSchedule(model, two_phases(), weights=weights)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        optimizer = MasterWeights(optimizer) if weights == "quantized" else optimizer
        schedule.attach(optimizer)
        return model, schedule, optimizer

    model, _, optimizer = start()
    losses = train(model, optimizer, STEPS)

    interrupted, schedule, optimizer = start()
    resumed_losses = train(interrupted, optimizer, saved_at)
    if checkpoint == "save_model":  # the file records the schedule's position
        qtensor.save_model(interrupted, tmp_path / "model.safetensors")
        torch.save({"optimizer": optimizer.state_dict()}, tmp_path / "state.pt")
    else:
        import torch.distributed.checkpoint as dcp

        saved = {"schedule": schedule.state_dict(), "model": interrupted.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.save(saved, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)

    resumed, schedule, optimizer = start()
    if checkpoint == "save_model":
        qtensor.load_model(resumed, tmp_path / "model.safetensors")  # moves the schedule to the file's step first
        assert (schedule.step_count, schedule.phase) == (saved_at, schedule.phase_at(saved_at))
        optimizer.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True)["optimizer"])
    else:
        # DCP fills a template shaped like the saved state: an optimizer that has stepped once (at
        # learning rate 0; the schedule's position is set after) has the saved one's entries.
        lr = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        for p in resumed.parameters():
            p.grad = torch.zeros_like(p.dequantize() if isinstance(p, qtensor.QuantizedTensor) else p)
        optimizer.step()
        optimizer.zero_grad()
        position = {"schedule": schedule.state_dict()}
        dcp.load(position, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        schedule.load_state_dict(position["schedule"])  # the layers in the saved step's formats, then their bytes
        state = {"model": resumed.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        optimizer.load_state_dict(state["optimizer"])
        assert [group["lr"] for group in optimizer.param_groups] == lr  # (the saved rate, restored)
    resumed_losses += train(resumed, optimizer, STEPS - saved_at, start=saved_at)

    assert resumed_losses == losses
    for ours, theirs in zip(values(resumed), values(model), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_a_failed_load_puts_the_schedule_and_its_layers_back(tmp_path, weights):
    """load_model of a file saved after the switch moves the model to the file's phase, and when
    the load then fails (a parameter the file lacks), the layers, parameters and the position are
    as they were: a failed load leaves the model untouched."""
    model = mlp()
    schedule = qtensor.PrecisionSchedule(model, two_phases(), weights=weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule.attach(MasterWeights(optimizer) if weights == "quantized" else optimizer)
    train(model, schedule.optimizer, SWITCH + 1)
    qtensor.save_model(model, tmp_path / "model.safetensors")

    other = mlp()
    other_schedule = qtensor.PrecisionSchedule(other, two_phases(), weights=weights)
    other_schedule.attach(MasterWeights(torch.optim.AdamW(other.parameters())) if weights == "quantized" else torch.optim.AdamW(other.parameters()))
    other.register_parameter("extra", nn.Parameter(torch.zeros(1)))  # the file lacks it: strict loading refuses
    before = [(p, p.linear_quantizers) for p in (other[0].weight, other[2].weight)]
    values_before = values(other)
    with pytest.raises(ValueError, match="missing keys"):
        qtensor.load_model(other, tmp_path / "model.safetensors")
    assert [(p, p.linear_quantizers) for p in (other[0].weight, other[2].weight)] == before
    assert all(torch.equal(a, b) for a, b in zip(values(other), values_before))
    assert (other_schedule.step_count, other_schedule.phase, other_schedule.switches) == (0, 0, [])
    assert [f[0] for f in formats(other)] == ["Float8Tensor"] * 2
    del other.extra
    qtensor.load_model(other, tmp_path / "model.safetensors")  # the same file loads once the model matches
    assert (other_schedule.step_count, other_schedule.phase) == (SWITCH + 1, 1)


def test_only_what_changes_is_switched_and_delayed_scaling_keeps_its_history_where_the_format_stays():
    """float8_delayed, then the same recipe with an MXFP8 forward (`forward_in`): the output
    gradient's quantizer compares equal to the one before, so it is kept with its amax history;
    the input and weight roles change and start fresh."""
    model = mlp()
    schedule = qtensor.PrecisionSchedule(model, [
        qtensor.Phase(0, qtensor.recipes.float8_delayed()),
        qtensor.Phase(2, qtensor.forward_in(qtensor.recipes.mxfp8(), qtensor.recipes.float8_delayed())),
    ])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    schedule.attach(optimizer)
    before = model[2].weight.linear_quantizers
    train(model, optimizer, 2)
    after = model[2].weight.linear_quantizers
    assert after.grad_output is before.grad_output  # the same object, its history carried over
    history = after.grad_output.state_buffers()["amax_history"]
    assert int((history > 0).sum()) == 2
    assert after.input is not before.input and isinstance(after.input, qtensor.HybridQuantizer)
    assert set(schedule.switches[0].changes["2"]) == {"input", "weight", "options"}  # (MXFP8 takes no fast accumulation)


def test_forward_in_high_precision_keeps_the_backward_quantized():
    """`forward_in(None, nvfp4)`: the forward GEMM multiplies the operands as they are (fp32 here:
    an IdentityQuantizer keeps the values; within the bf16 output's rounding, and the bias's, of
    the fp64 product), the backward's copies and the gradient stay NVFP4."""
    model = mlp()
    qtensor.PrecisionSchedule(model, [qtensor.Phase(0, qtensor.forward_in(None, qtensor.recipes.nvfp4()))])
    linear = model[0].weight.linear_quantizers
    assert isinstance(linear.grad_output, qtensor.NVFP4Quantizer)
    assert isinstance(linear.input.quantizer_for("rowwise"), qtensor.IdentityQuantizer)
    assert isinstance(linear.weight.quantizer_for("columnwise"), qtensor.NVFP4Quantizer)
    x, _ = batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model[0](x).detach().double().numpy()
    x, w, b = (t.detach().double().numpy() for t in (x, model[0].weight.plain(), model[0].bias))
    magnitude = np.abs(x) @ np.abs(w).T + np.abs(b)
    assert np.all(np.abs(y - (x @ w.T + b)) <= 2**-7 * magnitude)  # two roundings to bf16: the product's, the sum's
    assert not np.all(np.abs(y - (x @ w.T + b)) <= 2**-12 * magnitude)  # (the output is bf16: the bound is not loose)


def test_a_switch_recompiles_once_and_trains_as_eager():
    """A compiled model: one new graph at the switch, not one per step; its losses are the eager
    schedule's."""
    eager = mlp()
    compiled_model = mlp()
    schedules = [qtensor.PrecisionSchedule(m, two_phases()) for m in (eager, compiled_model)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled_model)]
    for schedule, optimizer in zip(schedules, optimizers):
        schedule.attach(optimizer)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_model, backend=counter)
    compiled_losses = train(compiled, optimizers[1], STEPS)
    eager_losses = train(eager, optimizers[0], STEPS)
    assert counter.frame_count == 2
    np.testing.assert_allclose(compiled_losses, eager_losses, rtol=1e-5)


def test_what_a_schedule_cannot_do_is_refused_before_anything_changes():
    """A held weight changing format without masters to cast it from; a later phase quantizing a
    layer the first keeps in high precision; phases out of order or fractions without the run's
    length; a saved state from another schedule."""
    model = mlp()
    schedule = qtensor.PrecisionSchedule(model, two_phases(), weights="quantized")
    schedule.attach(torch.optim.SGD([p for p in model.parameters() if not isinstance(p, qtensor.QuantizedTensor)], lr=0.1))
    weights = [model[0].weight, model[2].weight]
    with pytest.raises(ValueError, match="MasterWeights"):
        schedule.load_state_dict({"step": SWITCH, "phase_starts": [0, SWITCH]})
    assert [model[0].weight, model[2].weight] == weights and (schedule.phase, schedule.step_count) == (0, 0)
    assert model[0]._qtensor_layers["weight"][0].weight is weights[0].linear_quantizers.weight  # no layer switched
    # With several processes outside FSDP2 (DistributedDataParallel), a held weight's new parameter is refused.
    masters = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    schedule.attach(masters)
    with mock.patch.object(qtensor.schedule, "_several_processes", lambda: True), pytest.raises(NotImplementedError, match="DistributedDataParallel"):
        schedule.go_to_step(SWITCH)
    assert [model[0].weight, model[2].weight] == weights and schedule.step_count == 0
    # Refused when the schedule is made, not at the switch: a later phase quantize_ would refuse.
    late = qtensor.Recipe(qtensor.recipes.float8_delayed(), backward_override="dequantized")
    with pytest.raises(ValueError, match="backward_override"):
        qtensor.PrecisionSchedule(mlp(), [qtensor.Phase(0, qtensor.recipes.float8_current()), qtensor.Phase(5, late)])
    shared = qtensor.Float8Quantizer(scaling="delayed")
    with pytest.raises(ValueError, match="one delayed-scaling quantizer"):
        qtensor.PrecisionSchedule(mlp(), [qtensor.Phase(0, qtensor.recipes.float8_current()), qtensor.Phase(5, lambda role: shared)])
    with pytest.raises(ValueError, match="backward options would be lost"):
        qtensor.forward_in(qtensor.recipes.mxfp8(), qtensor.Recipe(qtensor.recipes.nvfp4(), backward_override="high_precision"))

    first_in_bf16 = lambda role: None if role.name == "2" else qtensor.recipes.float8_current()(role)
    with pytest.raises(ValueError, match="IdentityQuantizer"):
        qtensor.PrecisionSchedule(mlp(), [qtensor.Phase(0, first_in_bf16), qtensor.Phase(1, qtensor.recipes.mxfp8())])
    with pytest.raises(ValueError, match="start at step 0"):
        qtensor.PrecisionSchedule(mlp(), [qtensor.Phase(1, qtensor.recipes.mxfp8())])
    with pytest.raises(ValueError, match="total_steps"):
        qtensor.PrecisionSchedule(mlp(), [qtensor.Phase(0, qtensor.recipes.mxfp8()), qtensor.Phase(0.5, qtensor.recipes.nvfp4())])
    with pytest.raises(ValueError, match="saved with"):
        qtensor.PrecisionSchedule(mlp(), two_phases()).load_state_dict({"step": 1, "phase_starts": [0, 5]})


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_an_moe_models_expert_stacks_switch_as_by_hand(weights):
    """A tiny Qwen3-MoE through transformers' grouped_mm experts: float8_rowwise, then mxfp8 from
    step 2. The expert stacks switch with the attention projections (a held stack: each expert cast
    again from its master), and the run ends bit for bit where changing the recipe by hand ends."""
    from test_experts import tiny_model

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def moe():
        model = tiny_model("qwen3_moe")
        model.set_experts_implementation("grouped_mm")
        return model

    def steps(model, optimizer, count):
        losses = []
        for _ in range(count):
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    def optimizer_of(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return MasterWeights(optimizer) if weights == "quantized" else optimizer

    switch, total = 2, 4
    model = moe()
    schedule = qtensor.PrecisionSchedule(model, [qtensor.Phase(0, qtensor.recipes.float8_rowwise()), qtensor.Phase(switch, qtensor.recipes.mxfp8())], weights=weights)
    optimizer = optimizer_of(model)
    schedule.attach(optimizer)
    losses = steps(model, optimizer, total)
    switched = schedule.switches[0].changes
    assert {layer for layer in switched if layer.endswith(("gate_up_proj", "down_proj"))} == {
        f"model.layers.{i}.mlp.experts.{stack}" for i in range(2) for stack in ("gate_up_proj", "down_proj")}

    first = moe()
    qtensor.quantize_(first, qtensor.recipes.float8_rowwise(), weights=weights)
    by_hand = optimizer_of(first)
    hand_losses = steps(first, by_hand, switch)
    second = moe()
    qtensor.quantize_(second, qtensor.recipes.mxfp8(), weights=weights)
    continued = optimizer_of(second)
    with torch.no_grad():
        for theirs, ours in zip(first.parameters(), second.parameters()):
            if not isinstance(ours, qtensor.QuantizedTensor) and type(ours).__name__ != "QuantizedStack":
                ours.copy_(theirs)
    continued.load_state_dict(by_hand.state_dict())
    hand_losses += steps(second, continued, total - switch)
    assert losses == hand_losses
    stack = model.model.layers[0].mlp.experts.gate_up_proj
    if weights == "quantized":
        assert all(isinstance(expert, qtensor.MXFP8Tensor) for expert in stack.experts)
        for ours, theirs in zip(MasterWeights.masters(optimizer), MasterWeights.masters(continued)):
            assert torch.equal(ours, theirs)
    else:
        for ours, theirs in zip(model.parameters(), second.parameters()):
            assert torch.equal(ours.detach(), theirs.detach())
