"""Activation memory: what a quantized linear layer saves for its backward is the quantized copy
its backward GEMMs read (about 1 byte per element for the FP8 formats, 0.56 for NVFP4), measured
with saved-tensor hooks against the bytes each format's definition gives; and the tools that
act on saved tensors (activation checkpointing, reentrant and not; save_on_cpu, pinned or not)
keep it quantized and give gradients identical to a plain run."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import qtensor

ROWS, IN, OUT = 128, 256, 512  # multiples of every block size: no padding in the byte counts
RECIPES = ["float8_current", "float8_delayed", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd", "float8_rowwise", "float8_blockwise"]


def columnwise_bytes(recipe: str, rows: int, cols: int, role: str = "input") -> int:
    """Bytes of the columnwise copy of a [rows, cols] tensor, from each format's definition
    (docs/numerics.md, Buffer layouts): Float8 1 byte per element and one fp32 scale; MXFP8 1 byte per element and one
    E8M0 byte per 32; NVFP4 (the hybrid's columnwise child too) half a byte per element, one E4M3
    byte per 16 (per 16x16 tile: an nvfp4 weight) and one fp32 amax; row-wise FP8 1 byte per element
    and one fp32 scale per column; block-wise FP8 1 byte per element and one fp32 scale per 128 rows
    of a column (an input) or per 128x128 tile (a weight)."""
    n = rows * cols
    if recipe == "float8_rowwise":
        return n + 4 * cols
    if recipe == "float8_blockwise":
        return n + 4 * -(-rows // 128) * (cols if role == "input" else -(-cols // 128))
    if recipe.startswith("float8"):
        return n + 4
    if recipe == "mxfp8":
        return n + n // 32
    if recipe == "nvfp4" and role == "weight":
        return n // 2 + -(-rows // 16) * -(-cols // 16) + 4
    return n // 2 + n // 16 + 4


def saved_bytes(layer, x) -> tuple[int, list[torch.Tensor]]:
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(x)
    return sum(t.numel() * t.element_size() for t in saved), saved


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_saved_tensors_are_the_quantized_copies(recipe, weights):
    """The input's and the weight's columnwise copies, and nothing in high precision."""
    layer = nn.Linear(IN, OUT, bias=False).to(torch.bfloat16)
    qtensor.quantize_(layer, getattr(qtensor.recipes, recipe)(), weights=weights)
    x = torch.randn(ROWS, IN, dtype=torch.bfloat16, requires_grad=True)
    total, saved = saved_bytes(layer, x)
    assert total == columnwise_bytes(recipe, ROWS, IN) + columnwise_bytes(recipe, OUT, IN, "weight")
    # Nothing in high precision: no saved bf16/fp16 tensor, and fp32 only as scales (fewer elements than a block of 32 rows).
    assert not any(t.dtype in (torch.bfloat16, torch.float16) or t.dtype == torch.float32 and t.numel() >= 32 * IN for t in saved)
    bf16 = ROWS * IN * 2 + OUT * IN * 2  # what the same bf16 layer saves
    plain = nn.Linear(IN, OUT, bias=False).to(torch.bfloat16)
    assert saved_bytes(plain, x)[0] == bf16
    per_element = total / (ROWS * IN + OUT * IN)
    if recipe in ("float8_rowwise", "float8_blockwise"):
        return  # their fp32 scales per column or block are counted exactly above
    if recipe == "nvfp4":  # the input's scales per 16 elements, the weight's per 16x16 tile
        expected = (ROWS * IN * (0.5 + 1 / 16) + OUT * IN * (0.5 + 1 / 256)) / (ROWS * IN + OUT * IN)
    else:
        expected = 0.5625 if "nvfp4" in recipe else (1 + 1 / 32 if recipe == "mxfp8" else 1.0)
    assert per_element == pytest.approx(expected, abs=1e-3)


def block(recipe, seed=0):
    """An MLP block of three linear layers with a nonlinearity, quantized by `recipe`."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 32))
    qtensor.quantize_(model, getattr(qtensor.recipes, recipe)())
    return model


def gradients(model, x, run):
    """The input's and parameters' gradients of one step whose forward `run(model, x)` computes;
    torch's generator seeded alike for each run (stochastic rounding draws its keys from it)."""
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(1234)
    run(model, x).float().square().sum().backward()
    grads = [x.grad] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


RUNS = {
    "checkpoint_non_reentrant": lambda model, x: checkpoint(model, x, use_reentrant=False),
    "checkpoint_reentrant": lambda model, x: checkpoint(model, x, use_reentrant=True),
    "save_on_cpu": lambda model, x: _with(torch.autograd.graph.save_on_cpu(), model, x),
    "save_on_cpu_pinned": lambda model, x: _with(torch.autograd.graph.save_on_cpu(pin_memory=True), model, x),
}


def _with(context, model, x):
    with context:
        return model(x)


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpointing_and_offloading_give_identical_gradients(recipe, run):
    model = block(recipe)
    reference_model = copy.deepcopy(model)
    x = torch.randn(16, 64)
    expected = gradients(reference_model, x, lambda m, v: m(v))
    got = gradients(model, x, RUNS[run])
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_recomputation_saves_quantized_copies_too(recipe):
    """Reentrant checkpointing runs the forward without saving anything, then again in the backward:
    what that recomputation saves is quantized as well (seen by a hook installed inside the
    checkpointed function)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 32, bias=False)).to(torch.bfloat16)
    qtensor.quantize_(model, getattr(qtensor.recipes, recipe)())
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    seen = []

    def run(v):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.dtype) or t, lambda t: t):
            return model(v)

    run(x)
    once = list(seen)
    seen.clear()
    output = checkpoint(run, x, use_reentrant=True)
    assert seen == []  # the checkpointed forward keeps nothing
    output.float().sum().backward()
    assert seen == once  # the recomputation saves what a plain forward saves
    assert torch.bfloat16 not in once and {torch.float8_e4m3fn, torch.uint8} & set(once)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("recipe", ["float8_current", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"])
def test_a_cuda_step_offloaded_or_checkpointed_gives_identical_gradients(recipe, run):
    """On the GPU, with the Triton kernels: save_on_cpu moves the quantized buffers to (pinned) host
    memory and back, checkpointing recomputes them."""
    model = block(recipe).cuda().to(torch.bfloat16)
    reference_model = copy.deepcopy(model)
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    expected = gradients(reference_model, x, lambda m, v: m(v))
    got = gradients(model, x, RUNS[run])
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
