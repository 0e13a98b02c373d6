"""MasterWeights: high-precision masters for quantized parameters (docs/recipes.md, Weight modes)."""

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


def sgd_step_is_exact(optimizer, model, lr, grads):
    """The masters moved by exactly -lr * grad (plain SGD, computed in float64 here)."""
    for master, grad, before in grads:
        expected = before.double() - lr * grad.double()
        torch.testing.assert_close(master.detach().double(), expected, rtol=1e-6, atol=1e-7)


def one_step(model, optimizer, x, y, scale=1.0):
    """Backward and step; returns (master, gradient it should use, master before) per master."""
    loss = nn.functional.mse_loss(model(x), y)
    (loss * scale).backward()
    grads = [(m, p.grad.detach().clone() / scale, m.detach().clone()) for p, m in optimizer.pairs]
    return loss, grads


def test_it_is_a_torch_optimizer_that_lr_schedulers_step():
    model = quantized_model()
    optimizer = qtensor.optim.MasterWeights(torch.optim.SGD(model.parameters(), lr=1.0))
    assert isinstance(optimizer, torch.optim.Optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    x, y = regression_problem()
    for lr in (1.0, 0.5, 0.25):
        assert optimizer.param_groups[0]["lr"] == optimizer.optimizer.param_groups[0]["lr"] == lr
        _, grads = one_step(model, optimizer, x, y)
        optimizer.step()
        sgd_step_is_exact(optimizer, model, lr, grads)
        optimizer.zero_grad(set_to_none=False)  # in place, on the parameters' and the masters' gradients
        assert torch.count_nonzero(model[0].weight.grad) == 0 and torch.count_nonzero(optimizer.masters()[0].grad) == 0
        scheduler.step()
    assert scheduler.get_last_lr() == [0.125]
    # ReduceLROnPlateau takes it too.
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.1)
    plateau.step(1.0)
    plateau.step(2.0)
    assert optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0125)


def test_a_grad_scaler_unscales_the_gradients_the_step_uses():
    x, y = regression_problem()
    model = quantized_model()
    optimizer = qtensor.optim.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    _, grads = one_step(model, optimizer, x, y, scale=2.0**12)
    scaler.scale(torch.zeros(()))  # the scaler's state lives on the loss's device
    scaler.step(optimizer)
    scaler.update()
    sgd_step_is_exact(optimizer, model, 0.1, grads)  # the unscaled gradient moved the masters
    # An overflowing step is skipped: masters and quantized weights stay where they were.
    before = [m.detach().clone() for m in optimizer.masters()]
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss * float("inf")).backward()
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(m, b) for m, b in zip(optimizer.masters(), before))
    assert scaler.get_scale() == 2.0**11


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_clipping_the_model_parameters_reaches_the_masters(param_dtype):
    x, y = regression_problem()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16)).to(param_dtype)
    qtensor.quantize_(model, qtensor.recipes.mxfp8(), weights="quantized")
    optimizer = qtensor.optim.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    nn.functional.mse_loss(model(x.to(param_dtype)).float(), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    assert norm > 1e-2  # clipping really scales the gradients down
    grads = [(m, p.grad.float().clone(), m.detach().clone()) for p, m in optimizer.pairs]
    optimizer.step()
    sgd_step_is_exact(optimizer, model, 0.1, grads)


def test_changing_both_gradient_copies_after_backward_is_refused():
    x, y = regression_problem()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16)).to(torch.bfloat16)
    qtensor.quantize_(model, qtensor.recipes.mxfp8(), weights="quantized")
    optimizer = qtensor.optim.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
    optimizer.masters()[0].grad.mul_(0.5)  # as GradScaler.unscale_ would
    model[0].weight.grad.mul_(0.5)  # as clip_grad_norm_(model.parameters()) would
    with pytest.raises(ValueError, match="clip the optimizer's parameters"):
        optimizer.step()
