"""Expert stacks held quantized (`quantize_(..., weights="quantized")`): each expert's matrix cast
once, on its own, in both directions, and no high-precision values kept.

The GEMMs through every experts implementation are checked against the numpy oracle in
tests/test_experts.py in both weight modes; here, what holding a stack quantized adds: its bytes,
training through MasterWeights, checkpoints, dequantize_, and what it refuses.
"""

import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

import qtensor
import qtensor.hf
from qtensor.layers.quantized_stack import QuantizedStack
from qtensor.optim import MasterWeights
from test_experts import CASES, E, ENDS, K, N, ROWS, Stack, factory_for, tiny_model
from test_linear import varied

GROUPED = lambda m, x: torch._grouped_mm(x, m.weight_stack.transpose(-2, -1) if not m.is_transposed else m.weight_stack,
                                         offs=torch.tensor(ENDS, dtype=torch.int32))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def same_experts(mine, theirs) -> bool:
    """Every buffer of two stacks' experts holds the same bytes."""
    return all(
        same_bytes(a, b) for x, y in zip(mine.experts, theirs.experts) for a, b in zip(x.buffer_dict().values(), y.buffer_dict().values())
    )


def held_quantized(case, transposed=False, seed=1):
    module = Stack(transposed, seed=seed)
    original = [module.matrix(e) for e in range(E)]
    report = qtensor.quantize_(module, factory_for(case), weights="quantized", strict=True)
    assert report.quantized["weight_stack"].startswith("a stack of 4 experts") and report.quantized["weight_stack"].endswith("weights=quantized")
    return module, original


@pytest.mark.parametrize("transposed", [False, True], ids=["stack [E, out, in]", "stack [E, in, out]"])
@pytest.mark.parametrize("case", ["float8", "float8_rowwise", "mxfp8", "nvfp4"])
def test_each_expert_is_cast_on_its_own_and_only_low_precision_bytes_are_kept(case, transposed):
    module, original = held_quantized(case, transposed)
    stack = module.weight_stack
    assert type(stack).__name__ == "QuantizedStack" and stack.shape == ((E, K, N) if transposed else (E, N, K))
    deq = CASES[case][1]["weight"]
    for expert, matrix in zip(stack.experts, original):  # its own scales: the oracle's cast of that matrix alone
        for direction in ("rowwise", "columnwise"):
            np.testing.assert_array_equal(expert.dequantize(torch.float32, direction).numpy(), deq(matrix, direction).astype(np.float32))
    # Codes and scales only: 2 bytes an element (FP8, both copies) or less, never the float32 values.
    assert stack.storage_nbytes() <= 0.55 * E * N * K * 4
    assert all(buffer.dtype != torch.float32 or buffer[0].numel() <= N * K // 16 for buffer in stack.stacked.values())
    for (direction, name), buffer in stack.stacked.items():  # each expert's bytes are row e of the stacked buffers
        assert all(getattr(expert, direction).buffers[name].data_ptr() == buffer[e].data_ptr() for e, expert in enumerate(stack.experts))
    view = stack.detach().transpose(-2, -1)  # the other way round: its values too
    assert torch.equal(view.dequantize(), stack.dequantize().transpose(-2, -1))
    qtensor.dequantize_(module)  # plain values, as the module keeps them
    assert type(module.weight_stack) is nn.Parameter and module.weight_stack.shape == stack.shape
    for e, matrix in enumerate(original):
        values = module.weight_stack.detach()[e]
        np.testing.assert_array_equal((values.t() if transposed else values).numpy(), deq(matrix, "rowwise").astype(np.float32))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("case, whole", [("float8", True), ("float8_rowwise", True), ("mxfp8", True), ("nvfp4", True), ("hybrid", True)])
def test_a_stack_is_cast_in_one_go_where_the_format_allows_each_expert_with_its_own_scales(case, whole, device):
    """Float8 (per-tensor or row-wise scales, through the grouped casts), MXFP8 over experts of
    whole 32-row blocks (the stack as one matrix) and NVFP4 and the hybrid over experts of whole
    16-row blocks (the stack as one matrix in groups of an expert's rows, each at its own tensor
    scale: formats/nvfp4_groups.py) cast every expert of a stack at once, when
    quantize_ holds it and when MasterWeights writes it again (`requantize`): the weight
    quantizer's `quantize` runs at most twice (the first expert alone, for the layout, and the
    stack as one matrix), not once an expert. Each expert still gets its own scales: its two copies
    are the oracle's cast of its matrix alone."""
    experts, out_features, in_features = 8, 64, 96
    generator = torch.Generator().manual_seed(4)
    magnitudes = torch.logspace(-3, 3, experts)[:, None, None]  # experts of very different magnitudes
    module = nn.Module()
    module.down_proj = nn.Parameter((torch.randn(experts, out_features, in_features, generator=generator) * magnitudes).to(device))
    makers, calls = CASES[case][0], []

    def counting(role):
        quantizer = makers[role.tensor_type]()
        if role.tensor_type == "weight":
            quantize = quantizer.quantize
            quantizer.quantize = lambda *args, **kwargs: calls.append(1) or quantize(*args, **kwargs)
        return quantizer

    deq = CASES[case][1]["weight"]
    for values in (module.down_proj.detach().clone(), (torch.randn(experts, out_features, in_features, generator=generator) * magnitudes.flip(0)).to(device)):
        calls.clear()
        if not hasattr(module.down_proj, "requantize"):
            qtensor.quantize_(module, counting, weights="quantized")
        else:
            module.down_proj.requantize(values)
        assert len(calls) <= 2 if whole else len(calls) >= experts, len(calls)
        for expert, matrix in zip(module.down_proj.experts, values):
            for direction in ("rowwise", "columnwise"):
                np.testing.assert_array_equal(expert.dequantize(torch.float32, direction).cpu().numpy(), deq(matrix.cpu().numpy(), direction).astype(np.float32))


@pytest.mark.parametrize("case", ["float8", "mxfp8"])
def test_a_bf16_stack_is_cast_from_bf16_values_as_a_dense_weight_is(case):
    """MasterWeights writes fp32 masters into a bf16 stack: each expert is cast from the master
    rounded to bf16, as `copy_` casts a dense quantized weight from its own dtype, whether the
    stack is cast at once or expert by expert (the oracle casts each bf16 matrix alone)."""
    experts, out_features, in_features = 4, 64, 96
    generator = torch.Generator().manual_seed(5)
    module = nn.Module()
    module.down_proj = nn.Parameter(torch.randn(experts, out_features, in_features, generator=generator).bfloat16())
    qtensor.quantize_(module, factory_for(case), weights="quantized")
    masters = torch.randn(experts, out_features, in_features, generator=generator) * 3
    assert not torch.equal(masters, masters.bfloat16().float())
    with torch.no_grad():  # as MasterWeights writes its masters back
        module.down_proj.copy_(masters)
    deq = CASES[case][1]["weight"]
    for expert, matrix in zip(module.down_proj.experts, masters.bfloat16().float()):
        for direction in ("rowwise", "columnwise"):
            np.testing.assert_array_equal(expert.dequantize(torch.float32, direction).numpy(), deq(matrix.numpy(), direction).astype(np.float32))


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_master_weights_train_the_stacks_and_each_step_casts_every_expert_from_its_master(family, implementation):
    model = tiny_model(family)
    qtensor.quantize_(model, qtensor.recipes.float8_rowwise(), weights="quantized")
    model.set_experts_implementation(implementation)
    stacks = [p for p in model.parameters() if p.dim() == 3 and type(p).__name__ == "QuantizedStack"]
    assert len(stacks) == (2 if family == "deepseek_v3" else 4)  # gate_up_proj and down_proj of each MoE block
    optimizer = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    masters = dict(optimizer.pairs)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(4):
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert all(masters[stack].grad is stack.grad for stack in stacks)  # handed to the masters
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3
    quantizer = qtensor.Float8BlockQuantizer(block_rows=1, block_cols=None, pow2_scales=True)  # the recipe's weight role
    for stack in stacks:
        master = masters[stack].detach()
        matrices = master.transpose(-2, -1) if family == "gpt_oss" else master  # gpt-oss keeps [E, in, out]
        for expert, matrix in zip(stack.experts, matrices):
            fresh = quantizer.quantize(matrix, rowwise=True, columnwise=True)
            for direction in ("rowwise", "columnwise"):
                mine, theirs = getattr(expert, direction).buffers, getattr(fresh, direction).buffers
                assert all(same_bytes(mine[name], theirs[name]) for name in theirs)


def test_a_stack_held_quantized_saves_and_loads_byte_for_byte_expert_by_expert(tmp_path):
    module, _ = held_quantized("mxfp8")
    keys = list(module.state_dict())
    assert keys == [f"expert_weights.weight_stack.{e}" for e in range(E)]
    qtensor.save_model(module, tmp_path / "experts.safetensors")
    other, _ = held_quantized("mxfp8", seed=9)
    x = varied(ROWS, K, seed=2)
    assert not torch.equal(GROUPED(other, x), GROUPED(module, x))
    qtensor.load_model(other, tmp_path / "experts.safetensors")
    assert same_experts(other.weight_stack, module.weight_stack)
    assert torch.equal(GROUPED(other, x), GROUPED(module, x))
    # Into a model quantized otherwise: refused before anything is written, naming the expert.
    different, _ = held_quantized("float8")
    before = copy.deepcopy(different.weight_stack)
    with pytest.raises(ValueError, match=r"expert_weights\.weight_stack\.0: the model holds"):
        qtensor.load_model(different, tmp_path / "experts.safetensors")
    assert same_experts(different.weight_stack, before)
    # A plain stack (a dynamic model's entry, a plain checkpoint's) loads by casting each expert.
    plain = Stack(seed=5)
    module.load_state_dict(plain.state_dict())
    reference, _ = held_quantized("mxfp8", seed=5)
    assert torch.equal(GROUPED(module, x), GROUPED(reference, x))


def test_copies_of_a_stack_held_quantized_own_their_bytes():
    module, _ = held_quantized("float8_rowwise")
    x = varied(ROWS, K, seed=2)
    expected = GROUPED(module, x)
    copied = copy.deepcopy(module)
    stream = io.BytesIO()
    torch.save(module, stream)
    stream.seek(0)
    unpickled = torch.load(stream, weights_only=False)
    as_bf16 = copy.deepcopy(module).to(torch.bfloat16)  # the nominal dtype changes, not the bytes
    assert as_bf16.weight_stack.dtype == torch.bfloat16 and type(as_bf16.weight_stack).__name__ == "QuantizedStack"
    assert same_experts(as_bf16.weight_stack, module.weight_stack)
    assert GROUPED(as_bf16, x.bfloat16()).dtype == torch.bfloat16
    with torch.no_grad():
        module.weight_stack.copy_(torch.zeros(E, N, K))  # the original changes; the copies do not
    assert not GROUPED(module, x).any()
    assert torch.equal(GROUPED(copied, x), expected) and torch.equal(GROUPED(unpickled, x), expected)


def test_what_a_stack_held_quantized_refuses_says_what_to_do():
    module, _ = held_quantized("float8")
    stack = module.weight_stack
    # Whole experts are pieces of it (FSDP2's shards): views of their bytes, still quantized.
    first, second = torch.chunk(stack.detach(), 2, dim=0)
    assert type(second).__name__ == "QuantizedStack" and second.shape == (2, N, K)
    assert second.experts[0].rowwise.data.data_ptr() == stack.experts[2].rowwise.data.data_ptr()
    assert torch.equal(stack.detach()[1:3].dequantize(), stack.dequantize()[1:3])
    with pytest.raises(NotImplementedError, match="tensor parallelism shards a stack held dynamic"):
        stack.detach()[:, :8]  # a slice of each matrix
    with pytest.raises(NotImplementedError, match="tensor parallelism shards a stack held dynamic"):
        stack.detach().reshape(E * N, K)
    delayed = Stack()
    qtensor.quantize_(delayed, qtensor.recipes.float8_delayed(), weights="quantized")
    with pytest.raises(NotImplementedError, match="whose experts keep running state .delayed scaling. is not built"):
        torch.chunk(delayed.weight_stack.detach(), 2, dim=0)  # FSDP2's shards
    with pytest.raises(NotImplementedError, match="would write into an expert stack held quantized"):
        with torch.no_grad():
            stack.add_(1.0)
    # A read that has no quantized meaning runs on the dequantized values, and qtensor.fallbacks sees it.
    with qtensor.fallbacks("raise"), pytest.raises(RuntimeError, match="QuantizedStack"):
        stack.detach().sum()
    assert torch.equal(stack.detach().sum(), stack.dequantize().sum())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["float8", "float8_rowwise", "mxfp8"])
def test_on_the_gpu_a_stack_held_quantized_multiplies_as_the_dynamic_one(case):
    """Four experts of 16-aligned shapes, so each group's GEMMs run on the FP8 (or bf16) tensor
    cores reading each expert's bytes in place (its scale too: cuBLAS takes only 16-byte aligned
    scale pointers). The dynamic stack casts the same values to the same codes and scales, and the
    GPU tests of tests/test_experts.py hold it to the oracle: outputs and gradients are equal."""
    import torch.nn.functional as F

    experts, k, n, ends = 4, 128, 64, [32, 32, 96, 144]
    results = []
    for weights in ("dynamic", "quantized"):
        module = nn.Module()
        module.weight_stack = nn.Parameter(varied(experts, n, k, seed=1))
        qtensor.quantize_(module, factory_for(case), weights=weights)
        module.cuda()
        x = varied(ends[-1], k, seed=2).cuda().requires_grad_(True)
        y = F.grouped_mm(x, module.weight_stack.transpose(-2, -1), offs=torch.tensor(ends, dtype=torch.int32, device="cuda"))
        y.backward(varied(ends[-1], n, seed=3).cuda())
        results.append((y.detach(), x.grad, module.weight_stack.grad))
    for dynamic, held in zip(*results):
        assert torch.equal(dynamic, held)


_LOAD_WITHOUT_QTENSOR = """
import sys, transformers
for directory in sys.argv[1:]:
    try:
        transformers.AutoModelForCausalLM.from_pretrained(directory)
        print("loaded")
    except RuntimeError as error:
        print("raised", "mismatched" in str(error))
"""


def test_a_model_whose_only_quantized_layers_are_held_stacks_does_not_load_silently_without_qtensor(tmp_path):
    """save_pretrained writes a placeholder for each stack held quantized: empty matrices, which
    transformers' conversions store under its own names (Qwen3-MoE's per-expert `gate_proj`,
    Mixtral's `block_sparse_moe...w1`, gpt-oss's fused stacks). A process without qtensor stops on
    the size mismatch instead of initialising the stacks anew; with qtensor the model loads with
    its logits."""
    import subprocess
    import sys

    import transformers

    from test_experts import tiny_model

    directories = []
    for family in ("qwen3_moe", "mixtral", "gpt_oss"):
        tiny_model(family, layers=1).save_pretrained(tmp_path / family)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / family, quantization_config=qtensor.hf.QTensorConfig(recipe="float8_current", weights="quantized", modules_to_not_convert=["lm_head", "*.self_attn"]),
        )
        assert {type(p).__name__ for p in model.parameters()} == {"Parameter", "QuantizedStack"}
        model.save_pretrained(tmp_path / f"{family}_saved")
        directories.append(str(tmp_path / f"{family}_saved"))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}_saved")
        ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
        assert torch.equal(loaded(ids).logits, model(ids).logits), family
    result = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_QTENSOR, *directories], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:3] == ["raised True"] * 3, result.stdout


def _fp8_moe_config(family, width=128):
    """Tiny MoE configs (hidden 256) whose experts are whole 128x128 blocks at the default width."""
    import transformers

    common = dict(vocab_size=64, hidden_size=256, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=width, num_local_experts=4, num_experts_per_tok=2)
    return transformers.Qwen3MoeConfig(**common, intermediate_size=256, moe_intermediate_size=width, num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe, block", [("float8_current", [128, 128]), ("float8_blockwise", [128, 128]), ("float8_rowwise", [1, 128])])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fp8_export_writes_each_expert_in_the_fine_grained_layout(family, recipe, block, weights, tmp_path):
    """export(fp8=True) of Float8 expert stacks writes every expert under the keys transformers
    stores it under (Qwen3-MoE's `experts.<e>.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.<e>.w1.weight`,
    ...) with its `weight_scale_inv`: the codes times each block's scale are the expert's quantized
    values, and transformers' own FP8 loader (dequantizing, on a CPU) reads them back into the
    fused stacks as those values in bf16."""
    import json

    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_fp8_moe_config(family))
    qtensor.quantize_(model, getattr(qtensor.recipes, recipe)(), weights=weights)
    qtensor.hf.export(model, tmp_path / "fp8", fp8=True)
    written = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert written["weight_block_size"] == block and not any("experts" in name for name in written["modules_to_not_convert"])
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    moe = model.model.layers[0].mlp
    names = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"), "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}[family]
    experts = moe.experts
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8").model.layers[0].mlp.experts
    for attribute in ("gate_up_proj", "down_proj"):
        stack = getattr(experts, attribute)
        linear = experts._qtensor_layers[attribute][0]
        for expert in range(stack.shape[0]):
            if isinstance(stack, QuantizedStack):
                quantized = stack.experts[expert]
            else:
                quantized = linear.weight.quantize(stack.plain()[expert].detach(), rowwise=True, columnwise=False)
            values = quantized.dequantize(torch.float32)
            parts = {"gate_up_proj": (names[1], names[2]), "down_proj": (names[3],)}[attribute]
            for index, part in enumerate(parts):
                rows = slice(index * values.shape[0] // len(parts), (index + 1) * values.shape[0] // len(parts))
                key = f"model.layers.0.{names[0]}.experts.{expert}.{part}.weight"
                data, scale_inv = stored[key], stored[f"{key}_scale_inv"]
                assert data.dtype == torch.float8_e4m3fn, key
                per_element = scale_inv.repeat_interleave(block[0], 0)[: data.shape[0]].repeat_interleave(block[1], 1)[:, : data.shape[1]]
                assert torch.equal(data.float() * per_element, values[rows]), key
            assert torch.equal(getattr(loaded, attribute)[expert], values.to(torch.bfloat16)), (attribute, expert)


def test_fp8_export_of_delayed_scaling_stacks_writes_each_experts_own_scale(tmp_path):
    """A dynamic stack with delayed scaling casts each expert with its own quantizer: after a few
    steps the experts' histories differ, and each exported expert's scale is the one the oracle's
    delayed rule gives from that expert's history (as the next forward would cast it)."""
    import oracle
    import transformers
    from safetensors.torch import load_file

    from qtensor.formats.float8 import UNRECORDED

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_fp8_moe_config("qwen3_moe"))
    qtensor.quantize_(model, qtensor.recipes.float8_delayed())
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(4))
    for _ in range(3):
        model(tokens, labels=tokens).loss.backward()
    qtensor.hf.export(model, tmp_path / "fp8", fp8=True)
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    experts = model.model.layers[0].mlp.experts
    scales = []
    for expert in range(4):
        quantizer = experts._qtensor_layers["down_proj"][0].experts[expert].weight
        rule = oracle.Float8Delayed(
            amax_epsilon=quantizer.amax_epsilon, force_pow_2_scales=quantizer.force_pow_2_scales, amax_history_len=quantizer.amax_history_len,
            amax_compute_algo=quantizer.amax_compute_algo, margin=quantizer.margin,
        )
        rule.history = [np.float32(a) for a in quantizer.amax_history.tolist() if a != UNRECORDED]
        written = stored[f"model.layers.0.mlp.experts.{expert}.down_proj.weight_scale_inv"]
        assert torch.all(written == torch.tensor(np.float32(1) / rule.next_scale())), expert
        scales.append(written[0, 0].item())
    assert len(set(scales)) > 1  # the experts' own scales, not one quantizer's


@pytest.mark.parametrize("recipe", ["float8_current", "float8_rowwise"])
def test_fp8_export_of_narrow_experts(recipe, tmp_path):
    """Experts 64 wide: gate and up share one 128-row block of the stack, which transformers splits
    into two matrices of one partial block each, both taking that block's scale (read back exactly).
    Experts 192 wide are refused, saying why: down_proj's 192 columns are neither whole 128-column
    blocks nor one partial block, which transformers' loader would misread."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_fp8_moe_config("qwen3_moe", width=64))
    qtensor.quantize_(model, getattr(qtensor.recipes, recipe)(), weights="quantized")
    qtensor.hf.export(model, tmp_path / "fp8", fp8=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8").model.layers[0].mlp.experts
    stack = model.model.layers[0].mlp.experts.gate_up_proj
    for expert in range(4):
        assert torch.equal(loaded.gate_up_proj[expert], stack.experts[expert].dequantize(torch.float32).to(torch.bfloat16)), expert
    wide = transformers.AutoModelForCausalLM.from_config(_fp8_moe_config("qwen3_moe", width=192))
    qtensor.quantize_(wide, getattr(qtensor.recipes, recipe)(), weights="quantized")
    with pytest.raises(ValueError, match=r"mlp\.experts \[256, 192\]'\] are not whole 1?[0-9x]+ blocks"):  # down_proj's 192 columns
        qtensor.hf.export(wide, tmp_path / "wide", fp8=True)
    assert not (tmp_path / "wide").exists()


def test_fp8_export_refuses_gpt_oss_stacks_and_writes_experts_kept_in_high_precision(tmp_path):
    """gpt-oss stores its stacks [experts, in, out], which the layout's [out, in] experts cannot
    hold: export(fp8=True) refuses them, naming the layer. With the experts kept in high precision,
    the linear layers are written in FP8 and the experts modules named in `modules_to_not_convert`:
    transformers loads their plain values."""
    import json

    import transformers

    model = tiny_model("gpt_oss")
    quantized = copy.deepcopy(model)
    qtensor.quantize_(quantized, qtensor.recipes.float8_current(), weights="quantized")
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj \(an expert stack stored \[experts, in, out\]"):
        qtensor.hf.export(quantized, tmp_path / "refused", fp8=True)
    assert not (tmp_path / "refused").exists()
    config = _fp8_moe_config("qwen3_moe")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    kept = copy.deepcopy(model)
    qtensor.quantize_(kept, qtensor.recipes.float8_current(), exclude=["*.experts"])
    qtensor.hf.export(kept, tmp_path / "fp8", fp8=True)
    written = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "fp8" and "model.layers.0.mlp.experts" in written["modules_to_not_convert"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    experts = loaded.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj, model.model.layers[0].mlp.experts.gate_up_proj.detach().to(torch.bfloat16))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_from_pretrained_holds_the_stacks_quantized_and_save_pretrained_restores_them(family, tmp_path):
    """QTensorConfig(weights="quantized") quantizes the stacks after loading, as quantize_ does on the
    plain model (same bytes, same logits), and a save_pretrained directory loads back byte for byte."""
    import transformers

    from qtensor.hf import QTensorConfig

    tiny_model(family).save_pretrained(tmp_path / "plain")
    config = QTensorConfig(recipe="float8_rowwise", weights="quantized")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", quantization_config=config)
    by_hand = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    qtensor.quantize_(by_hand, qtensor.recipes.float8_rowwise(), weights="quantized")
    model.save_pretrained(tmp_path / "saved")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    stacks = [name for name, p in by_hand.named_parameters() if type(p).__name__ == "QuantizedStack"]
    assert len(stacks) == 4
    for other in (model, loaded):
        for name in stacks:
            mine, theirs = other.get_parameter(name), by_hand.get_parameter(name)
            assert type(mine).__name__ == "QuantizedStack"
            assert same_experts(mine, theirs)
        assert torch.equal(other(ids).logits, by_hand(ids).logits)


@pytest.mark.parametrize("case", ["float8", "float8_rowwise", "mxfp8"])
def test_torch_distributed_checkpoint_saves_and_loads_a_stack_held_quantized(case, tmp_path):
    """torch.distributed.checkpoint (in one process) writes the experts' entries and fills another
    model's in place: the loaded stack multiplies as the saved one."""
    import torch.distributed.checkpoint as dcp

    module, _ = held_quantized(case)
    other, _ = held_quantized(case, seed=9)
    x = varied(ROWS, K, seed=2)
    dcp.save(module.state_dict(), checkpoint_id=tmp_path)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=tmp_path)
    other.load_state_dict(state)
    assert same_experts(other.weight_stack, module.weight_stack)
    assert torch.equal(GROUPED(other, x), GROUPED(module, x))
