"""MasterWeights: high-precision masters for quantized parameters (API.md "Master weights")."""

import copy

import pytest
import torch
from torch import nn

import qtensor


def regression_problem(seed=0):
    generator = torch.Generator().manual_seed(seed)
    target = nn.Linear(32, 16)
    x = torch.randn(256, 32, generator=generator)
    with torch.no_grad():
        y = target(x)
    return x, y


def quantized_model(recipe=None):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
    qtensor.quantize_(model, recipe or qtensor.recipes.mxfp8(), weights="quantized")
    return model


def test_masters_replace_quantized_parameters_and_plain_ones_pass_through():
    model = quantized_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer = qtensor.optim.MasterWeights(inner)
    params = optimizer.param_groups[0]["params"]
    assert len(optimizer.masters()) == 2 and all(m.dtype == torch.float32 for m in optimizer.masters())
    assert not any(isinstance(p, qtensor.QuantizedTensor) for p in params)
    assert any(p is model[0].bias for p in params) and any(p is model[2].bias for p in params)  # plain ones untouched
    assert torch.equal(optimizer.masters()[0], model[0].weight.dequantize(torch.float32))


@pytest.mark.parametrize("recipe", ["mxfp8", "float8_current", "nvfp4", "mxfp8_fwd_nvfp4_bwd"])
def test_training_quantized_weights_converges_and_they_stay_quantized(recipe):
    x, y = regression_problem()
    model = quantized_model(getattr(qtensor.recipes, recipe)())
    weight_type = type(model[0].weight)
    optimizer = qtensor.optim.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    first = None
    for _ in range(150):
        loss = nn.functional.mse_loss(model(x), y)
        first = first if first is not None else loss.item()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert loss.item() < 0.1 * first, (first, loss.item())
    assert type(model[0].weight) is weight_type and isinstance(model[0].weight, nn.Parameter)
    assert model[0].weight.grad is None
    # the parameter holds the requantized master
    master = optimizer.masters()[0]
    fresh = model[0].weight.quantizer.quantize(master.detach(), rowwise=True, columnwise=True)
    assert torch.equal(model[0].weight.dequantize(torch.float32), fresh.dequantize(torch.float32))


def test_state_dict_round_trip_continues_training_identically():
    x, y = regression_problem()

    def step(model, optimizer):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    model = quantized_model()
    optimizer = qtensor.optim.MasterWeights(torch.optim.Adam(model.parameters(), lr=1e-2))
    for _ in range(3):
        step(model, optimizer)
    saved_model, saved_optimizer = copy.deepcopy(model), copy.deepcopy(optimizer.state_dict())

    other = quantized_model()
    resumed = qtensor.optim.MasterWeights(torch.optim.Adam(other.parameters(), lr=1e-2))
    other.load_state_dict(saved_model.state_dict())
    resumed.load_state_dict(saved_optimizer)
    for a, b in zip(optimizer.masters(), resumed.masters()):
        assert torch.equal(a, b)
    step(model, optimizer)
    step(other, resumed)
    for a, b in zip(model.parameters(), other.parameters()):
        a = a.dequantize() if isinstance(a, qtensor.QuantizedTensor) else a
        b = b.dequantize() if isinstance(b, qtensor.QuantizedTensor) else b
        assert torch.equal(a, b)


def test_zero_grad_clears_quantized_and_plain_gradients():
    x, y = regression_problem()
    model = quantized_model()
    optimizer = qtensor.optim.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    nn.functional.mse_loss(model(x), y).backward()
    assert model[0].weight.grad is not None and model[0].bias.grad is not None
    optimizer.zero_grad()
    assert model[0].weight.grad is None and model[0].bias.grad is None


def test_closure_steps_reach_the_quantized_weights():
    x, y = regression_problem()
    model = quantized_model()
    optimizer = qtensor.optim.MasterWeights(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5))
    before = model[0].weight.dequantize().clone()

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    first = closure().item()
    for _ in range(5):
        optimizer.step(closure)
    assert not torch.equal(model[0].weight.dequantize(), before)
    assert nn.functional.mse_loss(model(x), y).item() < 0.5 * first


def test_refusing_a_stepped_optimizer_leaves_it_untouched():
    model = quantized_model()
    inner = torch.optim.Adam(model.parameters())
    x, y = regression_problem()
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(TypeError, match="MasterWeights"):
        inner.step()  # stepping quantized parameters directly is refused
    # State it could still hold: loaded from a checkpoint of the same model's optimizer.
    plain = copy.deepcopy(model)
    qtensor.dequantize_(plain)
    plain_optimizer = torch.optim.Adam(plain.parameters())
    nn.functional.mse_loss(plain(x), y).backward()
    plain_optimizer.step()
    inner.load_state_dict(plain_optimizer.state_dict())
    params = list(inner.param_groups[0]["params"])
    with pytest.raises(ValueError, match="not stepped"):
        qtensor.optim.MasterWeights(inner)
    assert all(a is b for a, b in zip(params, inner.param_groups[0]["params"]))


def test_a_scheduler_drives_the_wrapped_optimizer():
    model = quantized_model()
    optimizer = qtensor.optim.MasterWeights(torch.optim.SGD(model.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1, gamma=0.5)
    x, y = regression_problem()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5
