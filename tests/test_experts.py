"""Expert stacks (a mixture of experts' fused 3-D weights) train quantized, each expert's matrix cast
on its own: through `F.linear(x, w[e])`, `torch.bmm` over gathered experts and the grouped GEMMs.

The reference is the one of tests/test_linear.py: each group of rows and each expert's matrix
dequantized by the independent numpy oracle (tests/oracle.py), multiplied in float64, compared
within fp32 accumulation-order tolerance.
"""

import contextlib
import copy
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import oracle
import qtensor
import workers
from qtensor.core import kernels
from qtensor.core.groups import RowGroups
from qtensor.formats import float8_groups
from qtensor.layers import grouped_linear
from test_linear import CASES as DENSE_CASES
from test_linear import assert_gemm_matches, varied

# The dense layer's cases (per-tensor Float8 with an E5M2 gradient, MXFP8, NVFP4, the hybrid), and
# two the grouped GEMM casts all at once (formats/float8_groups.py) and multiplies in one grouped
# FP8 GEMM each: per-tensor Float8 with every tensor E4M3, and row-wise FP8 (one scale per row, and
# per column of each group in the copies wgrad reads). The others run group by group.
_ROW = lambda: qtensor.Float8BlockQuantizer(block_rows=1, block_cols=None, pow2_scales=True)
_ROW_DEQ = lambda x, direction: oracle.float8_block(x, direction, block_rows=1, block_cols=None, pow2_scales=True).deq
_ROLES = ("input", "weight", "grad_output")
_E4M3_DEQ = lambda x, direction: oracle.float8_current(x, "e4m3").deq
CASES = {
    **DENSE_CASES,
    "float8_e4m3": ({role: qtensor.Float8Quantizer for role in _ROLES}, {role: _E4M3_DEQ for role in _ROLES}),
    "float8_rowwise": ({role: _ROW for role in _ROLES}, {role: _ROW_DEQ for role in _ROLES}),
}


def factory_for(case):
    makers = CASES[case][0]
    return lambda role: makers[role.tensor_type]()

E, K, N = 4, 80, 40
# Group ends over 67 rows: 16 rows, an empty group, 48 rows (one and a half MXFP8 blocks of rows),
# 16; three rows past the last end. Groups are whole multiples of 16 rows: NVFP4's Hadamard transform
# multiplies wgrad's operands in the transformed domain over the rows padded to a multiple of 16,
# which the oracle's dequantized copies (padding dropped) reproduce only for whole runs of 16.
ENDS = [16, 16, 64, 80]
ROWS = 83


class Stack(nn.Module):
    """A module holding one expert stack, `[E, N, K]` or stored `[E, K, N]` (`is_transposed`)."""

    def __init__(self, transposed=False, seed=1):
        super().__init__()
        self.is_transposed = transposed
        values = varied(E, N, K, seed=seed)
        self.weight_stack = nn.Parameter(values.transpose(1, 2).contiguous() if transposed else values)

    def matrix(self, expert):
        """Expert `expert`'s [N, K] matrix, in the values given at construction."""
        values = self.weight_stack.detach()
        return (values[expert].t() if self.is_transposed else values[expert]).numpy()


# Both weight modes: a dynamic stack (its values cast at each use) and one held quantized (each
# expert cast once, at quantize_); every group and expert gets the same codes and scales either way.
WEIGHTS = ["dynamic", "quantized"]


def quantized_stack(case, transposed=False, weights="dynamic"):
    module = Stack(transposed)
    original = [module.matrix(e) for e in range(E)]
    report = qtensor.quantize_(module, factory_for(case), weights=weights)
    assert list(report.quantized) == ["weight_stack"] and "a stack of 4 experts" in report.quantized["weight_stack"]
    return module, original


def check_group(case, y, x, w, grad, x_grad, w_grad):
    """One group: its output, input gradient and its expert's weight gradient against the oracle."""
    deq = CASES[case][1]
    assert_gemm_matches(y, deq["input"](x, "rowwise"), deq["weight"](w, "rowwise").T)
    assert_gemm_matches(x_grad, deq["grad_output"](grad, "rowwise"), deq["weight"](w, "columnwise"))
    assert_gemm_matches(w_grad, deq["grad_output"](grad, "columnwise").T, deq["input"](x, "columnwise"))


def run_grouped(module, x, grad, call):
    x = x.clone().requires_grad_(True)
    y = call(module, x)
    y.backward(grad)
    return y, x.grad, module.weight_stack.grad


GROUPED_CALLS = {
    "F.grouped_mm": lambda m, x: F.grouped_mm(x, m.weight_stack.transpose(-2, -1), offs=torch.tensor(ENDS, dtype=torch.int32)),
    "torch._grouped_mm": lambda m, x: torch._grouped_mm(x, m.weight_stack.transpose(-2, -1), torch.tensor(ENDS, dtype=torch.int32)),
    "stored [E, K, N]": lambda m, x: torch._grouped_mm(x, m.weight_stack, offs=torch.tensor(ENDS, dtype=torch.int32)),
    # transformers' own grouped GEMM (a custom op), which its grouped_mm experts call under torch.compile
    "transformers fallback": lambda m, x: transformers_fallback()(x, m.weight_stack.transpose(-2, -1), offs=torch.tensor(ENDS, dtype=torch.int32)),
}


def transformers_fallback():
    import transformers.integrations.moe  # noqa: F401 (registers the op)

    return torch.ops.transformers.grouped_mm_fallback


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("call", list(GROUPED_CALLS))
@pytest.mark.parametrize("case", list(CASES))
def test_a_grouped_gemm_runs_each_group_through_its_experts_quantized_linear(case, call, weights):
    module, w = quantized_stack(case, transposed=call == "stored [E, K, N]", weights=weights)
    x, grad = varied(ROWS, K, seed=2), varied(ROWS, N, seed=3)
    y, x_grad, w_grad = run_grouped(module, x, grad, GROUPED_CALLS[call])
    assert y.shape == (ROWS, N)
    w_grad = w_grad.transpose(1, 2) if module.is_transposed else w_grad
    for expert, (start, end) in enumerate(zip([0, *ENDS], ENDS)):
        if end == start:  # an empty group: its expert gets a zero gradient
            assert torch.equal(w_grad[expert], torch.zeros(N, K))
            continue
        rows = slice(start, end)
        check_group(case, y[rows], x[rows].numpy(), w[expert], grad[rows].numpy(), x_grad[rows], w_grad[expert])
    # Rows past the last group end: zero output, zero input gradient.
    assert torch.equal(y[ENDS[-1]:], torch.zeros(ROWS - ENDS[-1], N)) and torch.equal(x_grad[ENDS[-1]:], torch.zeros(ROWS - ENDS[-1], K))


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_a_batched_gemm_over_gathered_experts_runs_each_experts_rows_through_its_linear(case, transposed, weights):
    """transformers' batched_mm: `torch.bmm(w[ids], x[..., None])` (or `bmm(x[:, None], w[ids])` for a
    stack kept [E, K, N]). Each expert's rows, in the order they come, are one group; the gathered
    [rows, N, K] weights are never made."""
    module, w = quantized_stack(case, transposed, weights)
    # 32 rows of expert 2, 16 of experts 0 and 3, none of expert 1, interleaved.
    ids = torch.tensor([2, 0, 2, 3] * 16)
    x, grad = varied(len(ids), K, seed=4), varied(len(ids), N, seed=5)
    xr = x.clone().requires_grad_(True)
    gathered = module.weight_stack[ids]
    assert type(gathered).__name__ == "GatheredExperts"
    y = torch.bmm(xr.unsqueeze(1), gathered).squeeze(1) if transposed else torch.bmm(gathered, xr.unsqueeze(-1)).squeeze(-1)
    y.backward(grad)
    w_grad = module.weight_stack.grad
    w_grad = w_grad.transpose(1, 2) if transposed else w_grad
    for expert in range(E):
        rows = (ids == expert).nonzero().squeeze(1)
        if len(rows) == 0:
            assert torch.equal(w_grad[expert], torch.zeros(N, K))
            continue
        check_group(case, y[rows], x[rows].numpy(), w[expert], grad[rows].numpy(), xr.grad[rows], w_grad[expert])


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("case", list(CASES))
def test_one_expert_of_a_stack_is_a_quantized_linear_of_its_own(case, weights):
    """transformers' eager experts: `F.linear(x, w[e])` per expert hit."""
    module, w = quantized_stack(case, weights=weights)
    x, grad = varied(33, K, seed=6), varied(33, N, seed=7)
    xr = x.clone().requires_grad_(True)
    y = F.linear(xr, module.weight_stack[1])
    y.backward(grad)
    check_group(case, y, x.numpy(), w[1], grad.numpy(), xr.grad, module.weight_stack.grad[1])
    assert not module.weight_stack.grad[[0, 2, 3]].any()


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("frozen", ["nothing", "stack", "input"])
@pytest.mark.parametrize("override", [None, "high_precision", "dequantized"])
def test_the_grouped_gemm_equals_each_experts_dense_quantized_linear(override, frozen, weights):
    """The grouped GEMM (one autograd Function over the stack) gives, group by group, what each
    expert's own quantized linear gives (F.linear on that expert's matrix, the dense layer the
    oracle tests check), for every backward override and with the stack or the input frozen."""
    results = []
    for grouped in (True, False):
        module = Stack()
        qtensor.quantize_(module, qtensor.Recipe(factory_for("hybrid"), backward_override=override), weights=weights)
        module.weight_stack.requires_grad_(frozen != "stack")
        x = varied(ROWS, K, seed=2).requires_grad_(frozen != "input")
        if grouped:
            y = F.grouped_mm(x, module.weight_stack.transpose(-2, -1), offs=torch.tensor(ENDS, dtype=torch.int32))[: ENDS[-1]]
        else:
            y = torch.cat([F.linear(x[a:b], module.weight_stack[e]) for e, (a, b) in enumerate(zip([0, *ENDS], ENDS)) if b > a])
        y.backward(varied(ENDS[-1], N, seed=3))
        results.append((y.detach(), x.grad, module.weight_stack.grad))
    for grouped_result, dense_result in zip(*results):
        if dense_result is None:
            assert grouped_result is None
        else:
            torch.testing.assert_close(grouped_result[: len(dense_result)], dense_result, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["float8_e4m3", "float8_rowwise", "float8"])
def test_e4m3_float8_groups_are_cast_all_at_once(case):
    """E4M3 per-tensor and row-wise Float8 cast every group of a grouped GEMM in one go, forward and
    backward (one call over the routed rows each way, whatever the number of groups); with an E5M2
    gradient the groups are cast one by one. The oracle test above checks every case's codes and
    scales group by group."""
    module, _ = quantized_stack(case)
    with mock.patch.object(float8_groups, "cast_rows", wraps=float8_groups.cast_rows) as cast_rows:
        run_grouped(module, varied(ROWS, K, seed=2), varied(ROWS, N, seed=3), GROUPED_CALLS["F.grouped_mm"])
    assert cast_rows.call_count == (0 if case == "float8" else 2)


MANY_ENDS = {  # ten experts (more than grouped_linear.FEW_EXPERTS), three rows past the last end
    "groups of any size": [16, 16, 53, 80, 80, 96, 96, 96, 133, 160],
    "groups of whole blocks": [32, 32, 64, 128, 128, 128, 128, 160, 160, 160],
}


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("ends", list(MANY_ENDS))
@pytest.mark.parametrize("transposed", [False, True], ids=["stack [E, out, in]", "stack [E, in, out]"])
@pytest.mark.parametrize("case", ["mxfp8", "nvfp4", "hybrid", "float8", "float8_rowwise"])
def test_many_experts_cast_every_group_at_once_and_match_the_oracle(case, transposed, ends, weights):
    """Over more than a few experts (groups of 37 and 27 rows, empty ones, rows past the last end):
    MXFP8, NVFP4 and their hybrid with experts of whole blocks cast every group at once, the
    columnwise copies with each group run on to whole blocks of zero rows (none where every group
    is whole blocks), each group and expert at its own NVFP4 tensor scale; per-tensor Float8 with
    its E5M2 gradient casts every group at once and runs the backward's GEMMs group by group on
    those casts. Each group's output and gradients still match the oracle's per-group casts. (An
    NVFP4 wgrad copy with the Hadamard transform multiplies its values transformed over the rows
    padded to runs of 16, which the oracle's copies, padding dropped, reproduce only for groups of
    whole runs: the weight gradient is checked for those.)"""
    blocks = case in ("mxfp8", "nvfp4", "hybrid")
    padding = ends == "groups of any size" and case == "mxfp8"  # NVFP4's cast pads inside its kernel
    ends = MANY_ENDS[ends]
    experts, k, n, rows = 10, 80, 64, ends[-1] + 3
    module = nn.Module()
    values = varied(experts, n, k, seed=1)
    module.weight_stack = nn.Parameter(values.transpose(1, 2).contiguous() if transposed else values)
    module.is_transposed = transposed
    qtensor.quantize_(module, factory_for(case), weights=weights)
    x, grad = varied(rows, k, seed=2), varied(rows, n, seed=3)
    offs = torch.tensor(ends, dtype=torch.int32)
    stack = module.weight_stack if transposed else module.weight_stack.transpose(-2, -1)
    pads = []
    real_pad = RowGroups.pad
    counting_pad = lambda self, rows: pads.append(self.padded != self.lengths) or real_pad(self, rows)
    with mock.patch.object(RowGroups, "pad", counting_pad), \
            mock.patch.object(grouped_linear.GroupedLinearFunction, "apply", side_effect=AssertionError("group by group")), \
            mock.patch.object(float8_groups, "cast_rows", wraps=float8_groups.cast_rows) as cast_rows:
        y, x_grad, w_grad = run_grouped(module, x, grad, lambda m, x: F.grouped_mm(x, stack, offs=offs))
    assert sum(pads) == (2 if padding else 0)  # the input's and the gradient's columnwise copies, each in one go
    assert cast_rows.call_count == (0 if blocks else 2)  # the input's casts, and the gradient's
    w_grad = w_grad.transpose(1, 2) if transposed else w_grad
    deq = CASES[case][1]
    for expert, (start, end) in enumerate(zip([0, *ends], ends)):
        if end == start:
            assert torch.equal(w_grad[expert], torch.zeros(n, k))
            continue
        x_g, w_e, grad_g = x[start:end].numpy(), values[expert].numpy(), grad[start:end].numpy()
        if (end - start) % 16 == 0 or case in ("mxfp8", "float8", "float8_rowwise"):
            check_group(case, y[start:end], x_g, w_e, grad_g, x_grad[start:end], w_grad[expert])
        else:
            assert_gemm_matches(y[start:end], deq["input"](x_g, "rowwise"), deq["weight"](w_e, "rowwise").T)
            assert_gemm_matches(x_grad[start:end], deq["grad_output"](grad_g, "rowwise"), deq["weight"](w_e, "columnwise"))
    assert not y[ends[-1]:].any() and not x_grad[ends[-1]:].any()


@pytest.mark.parametrize("case", ["float8_e4m3", "float8_rowwise", "float8"])
def test_grouped_casts_equal_each_groups_own_cast_bit_for_bit(case):
    """Every group of routed rows (empty groups, groups of any length, NaN and ±Inf among the values)
    and every expert of a stack (48 rows, written columnwise by the cast, and 40, transposed after):
    the grouped casts' codes and factors are those of the dense cast of that group or expert alone,
    and a columnwise copy's padding holds zero codes."""
    quantizer = CASES[case][0]["grad_output"]()
    lengths = (0, 37, 64, 5, 0, 30)
    x = varied(sum(lengths), K, seed=4)
    x[3, 4], x[40, 2] = float("inf"), float("nan")
    groups = RowGroups(lengths, torch.tensor(lengths).cumsum(0))
    row, col = quantizer.quantize_groups(x, groups, True, True)
    bits = lambda t: t.view(torch.uint8)
    start = base = 0
    for group, length in enumerate(lengths):
        alone = quantizer.quantize(x[start:start + length]) if length else None
        if alone is not None:
            assert torch.equal(bits(row.data[start:start + length]), bits(alone.rowwise.data))
            assert torch.equal(row.scale_inv[start:start + length], alone.rowwise.scale_inv.reshape(-1).expand(length))
            assert torch.equal(bits(col.data[:, base:base + length]), bits(alone.columnwise.data))
            assert torch.equal(col.scale_inv[group], alone.columnwise.scale_inv.reshape(-1).expand(K))
        assert col.lengths[group] % 16 == 0 and not bits(col.data[:, base + length:base + col.lengths[group]]).any()
        start, base = start + length, base + col.lengths[group]
    for rows in (48, 40):
        stack = varied(3, rows, K, seed=5)
        row, col = quantizer.quantize_stack(stack, True, True)
        for expert in range(3):
            alone = quantizer.quantize(stack[expert])
            assert torch.equal(bits(row.data[expert]), bits(alone.rowwise.data))
            assert torch.equal(bits(col.data[expert]), bits(alone.columnwise.data))
            assert torch.equal(row.scale_inv[expert], alone.rowwise.scale_inv.reshape(-1).expand(rows))
            assert torch.equal(col.scale_inv[expert], alone.columnwise.scale_inv.reshape(-1).expand(K))


def test_a_grouped_gemm_over_a_stack_read_the_wrong_way_round_is_refused():
    module, _ = quantized_stack("mxfp8")
    with pytest.raises(NotImplementedError, match=r"reads a stack as \[experts, in, out\]; this one is \[experts, out, in\]"):
        F.grouped_mm(varied(ROWS, N, seed=2), module.weight_stack, offs=torch.tensor(ENDS, dtype=torch.int32))


@pytest.mark.parametrize("implementation, weights", [("batched_mm", "dynamic"), ("grouped_mm", "dynamic"), ("grouped_mm", "quantized")])
def test_a_compiled_moe_runs_its_experts_quantized(implementation, weights):
    """Under torch.compile the batched and grouped experts implementations run the stacks' quantized
    linears (eagerly, a graph break around each call over a stack): the compiled loss is the eager
    one, not the loss of the model whose experts stay in high precision (transformers' grouped_mm
    experts call its own grouped GEMM op under compile, which qtensor takes too), and so are the
    stacks' gradients (the compiled graph hands the grouped GEMM `stack.transpose(-2, -1)`, a view
    of the stack: its gradient reaches the stack as in the eager model). The eager implementation
    (F.linear per expert) compiles as any quantized linear does; Dynamo's tracing of its loop over
    the experts takes 17 s here, so it is not repeated in the suite."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for keep in ([], ["*.experts"]):
        model = tiny_model("qwen3_moe", layers=1)
        qtensor.quantize_(model, qtensor.recipes.float8_current(), exclude=["lm_head", *keep], weights=weights)
        model.set_experts_implementation(implementation)
        stacks = [p for name, p in model.named_parameters() if name.endswith(("gate_up_proj", "down_proj"))]
        # aot_eager: Dynamo's tracing and routing, which decide what runs quantized, without inductor's codegen time
        for forward in (model, torch.compile(model, backend="aot_eager")):
            loss = forward(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
            grads.append([p.grad.clone() for p in stacks])
            model.zero_grad(set_to_none=True)
    eager, compiled, plain_experts, _ = losses
    assert compiled == eager and eager != plain_experts
    for eager_grad, compiled_grad in zip(grads[0], grads[1]):
        assert type(compiled_grad) is torch.Tensor and torch.equal(compiled_grad, eager_grad)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_inside_high_precision_a_stack_multiplies_its_own_values(weights):
    module, _ = quantized_stack("mxfp8", weights=weights)
    x = varied(ROWS, K, seed=2)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    with qtensor.high_precision():
        y = F.grouped_mm(x, module.weight_stack.transpose(-2, -1), offs=offs)
    # its values: a dynamic stack's own, the dequantized experts of one held quantized
    plain = module.weight_stack.detach().plain() if weights == "dynamic" else module.weight_stack.dequantize()
    expected = torch.cat([x[a:b] @ plain[e].t() for e, (a, b) in enumerate(zip([0, *ENDS], ENDS))])
    torch.testing.assert_close(y[: ENDS[-1]], expected)


def test_a_grouped_gemm_with_bad_group_ends_says_what_they_must_be():
    module, _ = quantized_stack("float8")
    with pytest.raises(ValueError, match="4 non-decreasing group ends within the input's 83 rows"):
        F.grouped_mm(varied(ROWS, K, seed=2), module.weight_stack.transpose(-2, -1), offs=torch.tensor([16, 3, 40, 47], dtype=torch.int32))


def test_the_report_strict_exclude_and_a_role_for_experts_see_the_stacks():
    model = tiny_model("qwen3_moe")
    stacks = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    report = qtensor.quantize_(copy.deepcopy(model), qtensor.recipes.float8_current(), exclude=["lm_head"])
    assert all(name in report.quantized for name in stacks)
    assert report.skipped["model.layers.0.mlp.gate"].startswith("a mixture of experts' router (Qwen3MoeTopKRouter)")
    # strict=True accepts a model whose stacks are quantized and whose router stays in high precision.
    qtensor.quantize_(copy.deepcopy(model), qtensor.recipes.nvfp4(), strict=True)
    report = qtensor.quantize_(copy.deepcopy(model), qtensor.recipes.mxfp8(), exclude=["*.experts"])
    assert all(report.skipped[name].startswith("kept in high precision by exclude") for name in stacks)
    # A factory may choose by role: experts in high precision, the other linear layers in MXFP8.
    linear_only = qtensor.recipes.mxfp8()
    report = qtensor.quantize_(copy.deepcopy(model), lambda role: linear_only(role) if role.module_type == "linear" else None)
    assert all(report.skipped[name] == "the factory keeps every tensor in high precision" for name in stacks)
    assert "model.layers.0.self_attn.q_proj" in report.quantized


DELAYED_CALLS = {
    "grouped": lambda m, x: F.grouped_mm(x, m.weight_stack.transpose(-2, -1), offs=torch.tensor(ENDS, dtype=torch.int32)),
    "batched": lambda m, x: torch.bmm(m.weight_stack[EXPERT_OF_ROW], x.unsqueeze(-1)).squeeze(-1),
    "one expert at a time": lambda m, x: torch.cat(
        [F.linear(x[a:b], m.weight_stack[e]) if b > a else x.new_zeros(0, N) for e, (a, b) in enumerate(zip([0, *ENDS], ENDS))]
        + [x.new_zeros(ROWS - ENDS[-1], N)]
    ),
}
# The expert of each row, as the groups of ENDS give them (rows past the last end: expert 3).
EXPERT_OF_ROW = torch.bucketize(torch.arange(ROWS), torch.tensor(ENDS), right=True).clamp(max=E - 1)


@pytest.mark.parametrize("call", list(DELAYED_CALLS))
def test_delayed_scaling_keeps_one_amax_history_per_expert(call, tmp_path):
    """With delayed scaling each expert has its own quantizers: a training step records, in expert e's
    histories, the amax of its matrix, of its rows and of their gradient (an expert no row reached
    records nothing). The histories are state_dict entries per expert, and load into another model."""
    module = Stack()
    qtensor.quantize_(module, qtensor.recipes.float8_delayed())
    experts = module.weight_stack.linear_quantizers.experts
    assert len(experts) == E and len({id(q) for config in experts for q in config.roles().values()}) == 3 * E
    x, grad = varied(ROWS, K, seed=2), varied(ROWS, N, seed=3)
    ends = [*ENDS[:-1], ROWS] if call == "batched" else ENDS  # the batched form has no rows past an end
    before = {k: v.clone() for k, v in module.state_dict().items() if k.endswith("amax_history")}
    DELAYED_CALLS[call](module, x).backward(grad)
    values = module.weight_stack.detach().plain()
    for expert, (start, end) in enumerate(zip([0, *ends], ends)):
        recorded = {role: q.state_buffers()["amax_history"].max().item() for role, q in experts[expert].roles().items()}
        if end == start:
            prefix = f"expert_quantizers.weight_stack.{expert}."
            assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items() if k.startswith(prefix))
            continue
        expected = {"input": x[start:end].abs().max().item(), "weight": values[expert].abs().max().item(), "grad_output": grad[start:end].abs().max().item()}
        assert recorded == expected, expert
    state = module.state_dict()
    keys = {f"expert_quantizers.weight_stack.{e}.{role}_quantizer.amax_history" for e in range(E) for role in ("input", "weight", "grad_output")}
    assert keys <= set(state)
    qtensor.save_model(module, tmp_path / "delayed.safetensors")
    other = Stack()
    qtensor.quantize_(other, qtensor.recipes.float8_delayed())
    qtensor.load_model(other, tmp_path / "delayed.safetensors")
    for key in keys:
        assert torch.equal(other.state_dict()[key], state[key]), key


def tiny_config(family, layers=2):
    import transformers

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    if family == "deepseek_v3":  # multi-head latent attention, a shared expert, the first block dense
        return transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 2, "head_dim": 8}, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        )
    return transformers.GptOssConfig(
        **common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * layers
    )


def tiny_model(family, layers=2):
    import transformers

    classes = {
        "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
    }
    torch.manual_seed(0)
    return getattr(transformers, classes[family])(tiny_config(family, layers))


@pytest.mark.parametrize("recipe", ["float8_current", "mxfp8_fwd_nvfp4_bwd"])  # per-tensor FP8; MXFP8 + NVFP4 blocks
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_a_hugging_face_moe_trains_its_experts_quantized_with_every_implementation(family, recipe):
    """The three experts implementations of transformers give one forward (each expert's rows cast as
    one group whatever their order: the forward's casts are per row or per tensor), and the experts'
    quantized linears ran (their outputs differ from the unquantized experts')."""
    model = tiny_model(family)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    stacks = [name for name, p in model.named_parameters() if p.dim() == 3]
    assert stacks
    plain_experts = copy.deepcopy(model)
    qtensor.quantize_(plain_experts, getattr(qtensor.recipes, recipe)(), exclude=["lm_head", "*.experts"])
    losses = {}
    for implementation in ("eager", "batched_mm", "grouped_mm"):
        quantized = copy.deepcopy(model)
        report = qtensor.quantize_(quantized, getattr(qtensor.recipes, recipe)(), exclude=["lm_head"])
        assert all(name in report.quantized for name in stacks)
        quantized.set_experts_implementation(implementation)
        optimizer = torch.optim.SGD(quantized.parameters(), lr=0.1)
        first = quantized(ids, labels=ids).loss
        first.backward()
        assert all(quantized.get_parameter(name).grad.abs().sum() > 0 for name in stacks)
        optimizer.step()
        losses[implementation] = (first.item(), quantized(ids, labels=ids).loss.item())
    plain_loss = plain_experts(ids, labels=ids).loss.item()
    first = [loss for loss, _ in losses.values()]
    np.testing.assert_allclose(first, first[0], rtol=1e-5)
    assert abs(first[0] - plain_loss) > 1e-6, "the experts ran in high precision"
    assert all(after < before for before, after in losses.values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("call", list(GROUPED_CALLS))
@pytest.mark.parametrize("case", list(CASES))
def test_a_grouped_gemm_on_the_gpu_runs_each_group_through_its_experts_quantized_linear(case, call, weights):
    """As on the CPU, with the GPU's cast kernels (bit-identical to the references) and GEMMs: FP8
    tensor cores for Float8 (fast accumulation in fprop), bf16 tensor cores over exact values for the
    others. Their accumulation differs from fp32's, so the bound is 1e-3 of |A|·|B|, not 1e-5; a row
    through the wrong expert or group would miss it by orders of magnitude."""
    module, w = quantized_stack(case, transposed=call == "stored [E, K, N]", weights=weights)
    module.cuda()
    x, grad = varied(ROWS, K, seed=2), varied(ROWS, N, seed=3)
    y, x_grad, w_grad = (t.cpu() for t in run_grouped(module, x.cuda(), grad.cuda(), GROUPED_CALLS[call]))
    w_grad = w_grad.transpose(1, 2) if module.is_transposed else w_grad
    deq = CASES[case][1]
    for expert, (start, end) in enumerate(zip([0, *ENDS], ENDS)):
        if end == start:
            assert torch.equal(w_grad[expert], torch.zeros(N, K))
            continue
        rows, xe, ge = slice(start, end), x[start:end].numpy(), grad[start:end].numpy()
        gemm_within(y[rows], deq["input"](xe, "rowwise"), deq["weight"](w[expert], "rowwise").T)
        gemm_within(x_grad[rows], deq["grad_output"](ge, "rowwise"), deq["weight"](w[expert], "columnwise"))
        gemm_within(w_grad[expert], deq["grad_output"](ge, "columnwise").T, deq["input"](xe, "columnwise"))
    assert not y[ENDS[-1]:].any() and not x_grad[ENDS[-1]:].any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ends", [[32, 32, 96, 128, 128, 160, 192, 192, 224, 256], [16, 16, 53, 112, 112, 130, 161, 161, 200, 240]],
                         ids=["groups of 16s", "groups of any size"])
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("accumulation", ["split", "fast"])
@pytest.mark.parametrize("case", ["float8_e4m3", "float8_rowwise", "mxfp8", "nvfp4", "hybrid", "float8"])
def test_grouped_gemms_run_every_group_in_one_launch(case, ends, weights, accumulation):
    """A bf16 stack of ten experts and its input, every dimension a multiple of 32: each GEMM of the
    grouped linear is one grouped GEMM over every group (Float8 on the FP8 tensor cores: qtensor's
    grouped kernel for the split accumulator, `torch._scaled_grouped_mm` for fast accumulation;
    MXFP8: `torch._grouped_mm` over the exact bf16 values; per-tensor Float8 with an E5M2 gradient:
    the forward so, the backward group by group on the FP8 tensor cores, reading each group's slice
    of the grouped casts in place), within the bf16 output's rounding of the oracle's product,
    group by group. NVFP4 (and the hybrid's NVFP4 copies): qtensor's bf16 grouped GEMMs, each
    group's tensor scales in the epilogue; the weight gradient checked where a group is whole runs
    of 16 (the Hadamard transform's padding, as on the CPU)."""
    blocks = case in ("mxfp8", "nvfp4", "hybrid")
    if blocks and accumulation == "fast":
        pytest.skip("The block formats multiply their values on the bf16 tensor cores: no FP8 accumulation to choose")
    experts, k, n, rows = 10, 128, 64, 256
    module = nn.Module()
    module.weight_stack = nn.Parameter(varied(experts, n, k, seed=1).to(torch.bfloat16))
    w = [module.weight_stack[e].detach().float().numpy() for e in range(experts)]
    fast = accumulation == "fast"
    qtensor.quantize_(module, qtensor.Recipe(factory_for(case), fprop_fast_accumulation=fast, backward_fast_accumulation=fast), weights=weights)
    module.cuda()
    x, grad = varied(rows, k, seed=2).to(torch.bfloat16), varied(rows, n, seed=3).to(torch.bfloat16)
    call = lambda m, x: F.grouped_mm(x, m.weight_stack.transpose(-2, -1), offs=torch.tensor(ends, dtype=torch.int32, device="cuda"))
    launcher = "_grouped_mm" if blocks else "_scaled_grouped_mm"
    kernels.registered()
    names = ("grouped_mm.bf16_rows", "grouped_mm.bf16_columns") if blocks else ("grouped_mm.float8_rows", "grouped_mm.float8_columns")
    counted = {name: mock.Mock(wraps=kernels.TABLE.eager[name]) for name in names}
    with mock.patch.object(torch, launcher, wraps=getattr(torch, launcher)) as launches, mock.patch.dict(kernels.TABLE.eager, counted):
        y, x_grad, w_grad = (t.float().cpu() for t in run_grouped(module, x.cuda(), grad.cuda(), call))
    # (the model's own call, on the stack, passes through the patched function on its way to qtensor)
    torch_launches = sum(type(call.args[1]) is torch.Tensor for call in launches.call_args_list)
    ours = [counted[name].call_count for name in names]
    grouped_backward = case != "float8"  # per-tensor Float8's E5M2 gradient: the backward group by group
    if case == "mxfp8":
        assert (torch_launches, ours) == (3, [0, 0])
    elif case == "nvfp4":
        assert (torch_launches, ours) == (0, [2, 1])
    elif case == "hybrid":  # MXFP8 forward: no tensor scales
        assert (torch_launches, ours) == (1, [1, 1])
    elif fast:
        assert (torch_launches, ours) == (3 if grouped_backward else 1, [0, 0])
    else:
        assert (torch_launches, ours) == (0, [2, 1] if grouped_backward else [1, 0])
    deq = CASES[case][1]
    for expert, (start, end) in enumerate(zip([0, *ends], ends)):
        if end == start:
            assert not w_grad[expert].any()
            continue
        xe, ge = x[start:end].float().numpy(), grad[start:end].float().numpy()
        gemm_within(y[start:end], deq["input"](xe, "rowwise"), deq["weight"](w[expert], "rowwise").T, relative=4e-3)
        gemm_within(x_grad[start:end], deq["grad_output"](ge, "rowwise"), deq["weight"](w[expert], "columnwise"), relative=4e-3)
        if (end - start) % 16 == 0 or case not in ("nvfp4", "hybrid"):
            gemm_within(w_grad[expert], deq["grad_output"](ge, "columnwise").T, deq["input"](xe, "columnwise"), relative=4e-3)
    assert not y[ends[-1]:].any() and not x_grad[ends[-1]:].any()



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sizes", ["host", "device"])
@pytest.mark.parametrize("stack_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_backward_fast_accumulation_reaches_the_grouped_fp8_gemms(weights, stack_dtype, sizes):
    """`Recipe(..., backward_fast_accumulation=True)` on a row-wise Float8 stack, fprop with the
    split accumulator (qtensor's grouped kernel). With the groups' sizes on the host, dgrad and
    wgrad launch torch's grouped GEMM with fast accumulation, but an fp32 stack's wgrad runs
    qtensor's kernel with fast accumulation, which stores the bf16-rounded gradient in fp32 at once;
    with the sizes on the device (as while a CUDA graph is captured), both run qtensor's kernels
    with fast accumulation. Each stays
    within its bound (2**-7 of |A|·|B|, plus the bf16 output's rounding) of the oracle's product."""
    experts, k, n, ends = 10, 128, 64, [32, 32, 96, 128, 128, 160, 192, 192, 224, 256]
    module = nn.Module()
    module.weight_stack = nn.Parameter(varied(experts, n, k, seed=1).to(stack_dtype))
    w = [module.weight_stack[e].detach().float().numpy() for e in range(experts)]
    qtensor.quantize_(module, qtensor.Recipe(factory_for("float8_rowwise"), backward_fast_accumulation=True), weights=weights)
    module.cuda()
    x, grad = varied(ends[-1], k, seed=2).to(torch.bfloat16), varied(ends[-1], n, seed=3).to(torch.bfloat16)
    call = lambda m, x: F.grouped_mm(x, m.weight_stack.transpose(-2, -1), offs=torch.tensor(ends, dtype=torch.int32, device="cuda"))
    kernels.registered()
    split_fprop = mock.Mock(wraps=kernels.TABLE.eager["grouped_mm.float8_rows"])
    wgrad = mock.Mock(wraps=kernels.TABLE.eager["grouped_mm.float8_columns"])
    on_device = mock.patch.object(grouped_linear, "sizes_on_device", grouped_linear.takes_sizes_on_device) if sizes == "device" else contextlib.nullcontext()
    with mock.patch.object(torch, "_scaled_grouped_mm", wraps=torch._scaled_grouped_mm) as launches, \
            mock.patch.dict(kernels.TABLE.eager, {"grouped_mm.float8_rows": split_fprop, "grouped_mm.float8_columns": wgrad}), \
            on_device, torch.autocast("cuda", dtype=torch.bfloat16):
        y, x_grad, w_grad = (t.float().cpu() for t in run_grouped(module, x.cuda(), grad.cuda(), call))
    if sizes == "host":
        ours = stack_dtype == torch.float32
        assert [c.kwargs["use_fast_accum"] for c in launches.call_args_list] == [True] * (1 if ours else 2)
        assert [c.args[6] for c in split_fprop.call_args_list] == [False]  # fprop: the factory's own choice, the split accumulator
        assert [c.args[6] for c in wgrad.call_args_list] == ([True] if ours else [])  # fast accumulation
    else:
        assert not launches.called
        assert [c.args[6] for c in split_fprop.call_args_list] == [False, True]  # fprop split, dgrad fast
        assert [c.args[6] for c in wgrad.call_args_list] == [True]
    deq = CASES["float8_rowwise"][1]
    for expert, (start, end) in enumerate(zip([0, *ends], ends)):
        if end == start:
            continue
        xe, ge = x[start:end].float().numpy(), grad[start:end].float().numpy()
        gemm_within(x_grad[start:end], deq["grad_output"](ge, "rowwise"), deq["weight"](w[expert], "columnwise"), relative=1e-2)
        gemm_within(w_grad[expert], deq["grad_output"](ge, "columnwise").T, deq["input"](xe, "columnwise"), relative=1e-2)



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("weights", WEIGHTS)
def test_an_fp32_mxfp8_stacks_weight_gradient_is_stored_in_fp32_by_qtensors_kernel(weights):
    """An fp32 MXFP8 stack under bf16 autocast: fprop and dgrad run torch's bf16 grouped GEMM over
    the copies' values, wgrad qtensor's `bf16_columns`, which reads the columnwise copies' values in
    place and stores the bf16-rounded gradient as fp32 (no conversion pass); the gradient is fp32,
    each expert's within the bf16 rounding of the oracle's product."""
    experts, k, n, ends = 10, 128, 64, [32, 32, 96, 128, 128, 160, 192, 192, 224, 256]
    module = nn.Module()
    module.weight_stack = nn.Parameter(varied(experts, n, k, seed=1))
    qtensor.quantize_(module, qtensor.Recipe(factory_for("mxfp8")), weights=weights)
    module.cuda()
    x, grad = varied(ends[-1], k, seed=2).to(torch.bfloat16), varied(ends[-1], n, seed=3).to(torch.bfloat16)
    call = lambda m, x: F.grouped_mm(x, m.weight_stack.transpose(-2, -1), offs=torch.tensor(ends, dtype=torch.int32, device="cuda"))
    kernels.registered()
    wgrad = mock.Mock(wraps=kernels.TABLE.eager["grouped_mm.bf16_columns"])
    with mock.patch.object(torch, "_grouped_mm", wraps=torch._grouped_mm) as launches, \
            mock.patch.dict(kernels.TABLE.eager, {"grouped_mm.bf16_columns": wgrad}), torch.autocast("cuda", dtype=torch.bfloat16):
        y, x_grad, w_grad = run_grouped(module, x.cuda(), grad.cuda(), call)
    assert w_grad.dtype == torch.float32
    assert sum(type(c.args[1]) is torch.Tensor for c in launches.call_args_list) == 2 and wgrad.call_count == 1
    deq = CASES["mxfp8"][1]
    w_grad = w_grad.cpu()
    for expert, (start, end) in enumerate(zip([0, *ends], ends)):
        if end == start:
            assert not w_grad[expert].any()
            continue
        xe, ge = x[start:end].float().numpy(), grad[start:end].float().numpy()
        gemm_within(w_grad[expert], deq["grad_output"](ge, "columnwise").T, deq["input"](xe, "columnwise"), relative=4e-3)



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fprop_fast", [False, True], ids=["split", "fast fprop"])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_grouped_float8_layers_leave_the_groups_sizes_on_the_device(weights, fprop_fast):
    """Row-wise Float8 over more than a few experts under bf16 autocast, with an empty group and rows
    past the last group's. Eager, the layer reads the groups' sizes to the host. Captured in a CUDA
    graph (where the host cannot read them), its forward and backward leave them on the device,
    and the replay is bit for bit the eager layer run so (`takes_sizes_on_device`), which reads
    nothing from the device (no `tolist`, `item`) and zeroes the rows past the last group's in the
    output and the input's gradient. That layer against the one with the sizes on the host: bit for
    bit with the split accumulator (the same kernels either way); with fast accumulation in the
    forward (torch's grouped GEMM with the sizes on the host, qtensor's without), within its bound."""
    experts, k, n, ends = 10, 128, 64, [32, 32, 96, 128, 128, 160, 192, 192, 224, 256]
    rows = ends[-1] + 24
    recipe = qtensor.Recipe(factory_for("float8_rowwise"), fprop_fast_accumulation=fprop_fast)
    x, grad = varied(rows, k, seed=2).to(torch.bfloat16).cuda(), varied(rows, n, seed=3).to(torch.bfloat16).cuda()
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")

    def layer():
        module = nn.Module()
        module.weight_stack = nn.Parameter(varied(experts, n, k, seed=1))
        qtensor.quantize_(module, recipe, weights=weights)
        return module.cuda()

    def step(module, x):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            y = F.grouped_mm(x, module.weight_stack.transpose(-2, -1), offs=offs)
        y.backward(grad)
        return y

    def eager(on_device):
        module, reads = layer(), []
        tolist, item = torch.Tensor.tolist, torch.Tensor.item
        decide = grouped_linear.takes_sizes_on_device if on_device else grouped_linear.sizes_on_device
        with mock.patch.object(grouped_linear, "sizes_on_device", decide), \
                mock.patch.object(torch.Tensor, "tolist", lambda t: reads.append("tolist") or tolist(t)), \
                mock.patch.object(torch.Tensor, "item", lambda t: reads.append("item") or item(t)):
            x_ = x.clone().requires_grad_(True)
            y = step(module, x_)
        return [t.float() for t in (y, x_.grad, module.weight_stack.grad)], reads

    def graphed():
        module, x_ = layer(), x.clone().requires_grad_(True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up, then the step captured and replayed
            step(module, x_)
        torch.cuda.current_stream().wait_stream(side)
        x_.grad = module.weight_stack.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = step(module, x_)
        graph.replay()
        torch.cuda.synchronize()
        return [t.float() for t in (y, x_.grad, module.weight_stack.grad)]

    free, reads = eager(True)
    host, host_reads = eager(False)
    assert reads == [] and host_reads  # eager, the layer reads the ends
    assert not free[0][ends[-1]:].any() and not free[1][ends[-1]:].any()
    for ours, theirs in zip(free, host):
        if fprop_fast:
            torch.testing.assert_close(ours, theirs, rtol=2**-6, atol=2**-6 * theirs.abs().max().item())
        else:
            assert torch.equal(ours, theirs)
    for replayed, ours in zip(graphed(), free):
        assert torch.equal(replayed, ours)


@pytest.mark.parametrize("case", ["float8_rowwise", "float8_e4m3"])
def test_groups_whose_sizes_the_host_does_not_know_cast_as_groups_it_knows(case):
    """`RowGroups(None, ends, rows=M)`: the groups' sizes stay on the device (read only when asked);
    each row's group, the bound on the padded runs, and the grouped casts of the rows (rowwise,
    and each group's columnwise run) are those of the same groups sized on the host, the rows past
    the last group's aside."""
    lengths = (5, 0, 40, 16, 0)
    ends = torch.tensor(lengths).cumsum(0).to(torch.int32)
    total, rows = sum(lengths), sum(lengths) + 11
    unknown, known = RowGroups(None, ends, rows=rows), RowGroups(lengths, ends)
    expected_groups = np.repeat(np.arange(len(lengths)), lengths)
    assert np.array_equal(unknown.of_rows()[:total].numpy(), expected_groups)
    assert unknown.aligned(16).padded_rows() >= sum(known.aligned(16).padded) and unknown.aligned(16).padded_rows() % 16 == 0
    assert not unknown.sized_on_host and not unknown.aligned(16).sized_on_host
    quantizer = factory_for(case)(qtensor.Role("linear", "input", "layer"))
    x = varied(rows, 48, seed=7)
    (row_u, col_u), (row_k, col_k) = quantizer.quantize_groups(x, unknown, True, True), quantizer.quantize_groups(x[:total], known, True, True)
    assert torch.equal(row_u.data[:total].view(torch.uint8), row_k.data.view(torch.uint8))
    assert torch.equal(row_u.scale_inv[:total], row_k.scale_inv)
    columns = col_k.data.shape[1]
    assert torch.equal(col_u.data[:, :columns].view(torch.uint8), col_k.data.view(torch.uint8))
    assert torch.equal(col_u.scale_inv, col_k.scale_inv)
    assert unknown.lengths == lengths  # read from the device when asked



def test_a_second_grouped_gemm_over_the_same_offsets_reads_no_ends_from_the_device():
    """The gate_up and down GEMMs of a layer share their offsets: the second takes the ends the first
    read (no second device-to-host read), until the offsets change in place, when they are read again."""
    module, w = quantized_stack("float8_e4m3")
    x = varied(ROWS, K, seed=2)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    call = lambda: F.grouped_mm(x, module.weight_stack.transpose(-2, -1), offs=offs)
    reads, tolist = [], torch.Tensor.tolist

    def counted(tensor):
        reads.append(tensor)
        return tolist(tensor)

    with mock.patch.object(torch.Tensor, "tolist", counted):
        first, second = call(), call()
        assert len(reads) == 1 and torch.equal(first, second)
        offs[1] = 32  # in place: rows 16:32 now belong to expert 1 (empty before)
        moved = call()
        assert len(reads) == 2
    deq = CASES["float8_e4m3"][1]
    assert_gemm_matches(moved[16:32], deq["input"](x[16:32].numpy(), "rowwise"), deq["weight"](w[1], "rowwise").T)


def gemm_within(actual, a, b, relative=1e-3):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    error = np.abs(actual.detach().double().numpy() - a @ b)
    bound = relative * (np.abs(a) @ np.abs(b)) + 1e-30
    assert np.all(error <= bound), f"max error/bound {np.max(error / bound):.3g}"


SHARDED_EXPERTS = workers.Background("sharded_experts", workers.rank_commands("experts_fsdp_case.py", world=2), timeout=300)


@pytest.fixture
def sharded_experts():
    """The folder of experts_fsdp_case.py's results.pt (2 ranks started early: workers.Background)."""
    return SHARDED_EXPERTS.results()


def test_fsdp2_shards_a_stack_by_experts_and_trains_as_one_process(sharded_experts):
    """FSDP2 over 2 gloo ranks shards a dynamic stack along its experts, each rank casting its own
    experts (each on its own) and gathering their codes and scales (with delayed scaling, whose
    state is per expert, the stack's high-precision values, cast after the gather), and a stack
    held quantized as whole experts, gathered as their codes and scales (MasterWeights casting each
    expert of a shard on its own). Three steps of each recipe end where one process ends, also with
    3 experts over the 2 ranks (an uneven split: a held stack gathers its experts' bytes packed into
    FSDP2's padded shard, in a dtype gloo carries, a dynamic one its values), and with 1 expert
    over the 2 ranks (a held stack's rank with none sends only padding). The layer resharded under a root, with activation
    checkpointing, and accumulating gradients without resharding after the backward gets the
    gradients of one process. A sharded held stack saves whole (save_model gathers its experts' bytes) into a file
    that loads into one process and into a sharded model; torch.distributed.checkpoint saves either
    kind of stack from both ranks and loads it into a freshly sharded model, whose output is then the
    saved model's. With delayed scaling every expert's amax histories end equal too, also with two
    micro-batches a step: a gather of new values (after an optimizer step) counts as a write of the
    gathered stack, whose casts and weight amaxes are then made again, and a gather of the same
    values (the next micro-batch) does not."""
    results = torch.load(sharded_experts / "results.pt", weights_only=False)
    assert {"float8_delayed", "float8_delayed, 2 micro-batches", "float8_current", "float8_rowwise"} <= set(results)
    # Resharded under a root, with activation checkpointing, and accumulating without resharding
    # after the backward: the gradients of one process, for held and dynamic stacks.
    for scenario, (worst, losses) in results.pop("scenarios").items():
        assert np.all(np.isfinite(losses)) and worst < 1e-5, (scenario, worst, losses)
        np.testing.assert_allclose(losses[1::2], losses[0::2], rtol=1e-5, err_msg=scenario)
    for recipe, result in results.items():
        single_histories, sharded_histories = result["histories"]
        assert single_histories.keys() == sharded_histories.keys()
        assert bool(single_histories) == recipe.startswith("float8_delayed"), recipe
        for name, history in single_histories.items():
            assert torch.equal(sharded_histories[name], history), (recipe, name)
        assert set(result["types"].values()) == {"QuantizedStack" if "quantized" in recipe else "DynamicWeight"}, recipe
        # Gathered as the experts' codes and scales, never their values: a stack held quantized, and a
        # dynamic one whose experts keep no running state and split evenly (each rank casts its own).
        if "quantized" in recipe or not (recipe.startswith("float8_delayed") or recipe.endswith(("3 experts", "1 expert"))):
            for kind, dtypes in result["unsharded"].values():
                assert kind == "QuantizedStack" and any("float8" in d for d in dtypes) and "torch.bfloat16" not in dtypes, (recipe, dtypes)
        else:
            assert {kind for kind, _ in result["unsharded"].values()} == {"DynamicWeight"}, recipe
        # torch.distributed.checkpoint over both ranks into a freshly sharded model: the same output.
        assert result["dcp_equal"] in ((None,) if recipe.startswith("float8_delayed") else (True,)), recipe
        sent, bf16 = result["gathered_bytes"]  # what the gathers sent, and the same shards in bf16
        if recipe == "nvfp4":  # two copies of 4-bit codes with their scales
            assert 0 < sent < 0.6 * bf16, (sent, bf16)
        if "quantized" in recipe:
            # save_model of the sharded model loads into one process with its bytes, and back into a sharded model.
            assert result["reloaded"] == (True, True), recipe
        np.testing.assert_allclose(result["sharded"], result["single"], rtol=1e-5, err_msg=recipe)
        for name, expected in result["expected"].items():
            gathered = result["gathered"][name]
            torch.testing.assert_close(getattr(gathered, "plain", lambda: gathered)(), expected, rtol=1e-5, atol=1e-6)


SHARDED_ONE_RANK = workers.Background("sharded_on_one_rank", workers.rank_commands("stack_one_rank_case.py", world=1), timeout=120)


@pytest.fixture
def sharded_on_one_rank():
    """The folder of stack_one_rank_case.py's results.pt (a worker started early: workers.Background)."""
    return SHARDED_ONE_RANK.results()


def test_fsdp2_over_one_rank_gathers_a_held_stack_whole(sharded_on_one_rank):
    """On one rank FSDP2 copies only the first all-gather input into its output: a stack held
    quantized sends its buffers packed in one, and trains as the unsharded layer does."""
    for recipe, (single, sharded) in torch.load(sharded_on_one_rank / "results.pt", weights_only=False).items():
        np.testing.assert_allclose(sharded, single, rtol=1e-6, err_msg=recipe)


def test_a_stack_saves_loads_and_dequantizes_as_its_plain_values(tmp_path):
    """A dynamic stack's state_dict entry is its plain values; save_model / load_model carry them
    byte for byte into another quantized model, and dequantize_ gives back a plain parameter."""
    module = Stack()
    qtensor.quantize_(module, qtensor.recipes.mxfp8())
    values = module.weight_stack.detach().plain().clone()
    assert type(module.state_dict()["weight_stack"]) is torch.Tensor
    qtensor.save_model(module, tmp_path / "experts.safetensors")
    other = Stack(seed=9)
    qtensor.quantize_(other, qtensor.recipes.mxfp8())
    qtensor.load_model(other, tmp_path / "experts.safetensors")
    assert type(other.weight_stack).__name__ == "DynamicWeight" and torch.equal(other.weight_stack.detach().plain(), values)
    qtensor.dequantize_(other)
    assert type(other.weight_stack) is nn.Parameter and torch.equal(other.weight_stack.detach(), values)
