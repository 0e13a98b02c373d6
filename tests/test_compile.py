"""torch.compile over quantized tensors: the flatten context lets the compiler guard on them.

Each type's `dequantize` compiles with fullgraph=True (no graph break) and runs again on a new
tensor with new values without recompiling; the compiled result equals the eager one.
"""

import pytest
import torch
import torch._dynamo.testing

import qtensor

TYPES = {
    "Float8Tensor": lambda: qtensor.Float8Quantizer(scaling="delayed"),
    "MXFP8Tensor": lambda: qtensor.MXFP8Quantizer(),
    "NVFP4Tensor": lambda: qtensor.NVFP4Quantizer(rht=True),
    "IdentityTensor": lambda: qtensor.IdentityQuantizer(),
    "HybridQuantizedTensor": lambda: qtensor.HybridQuantizer(qtensor.MXFP8Quantizer(), qtensor.NVFP4Quantizer()),
}


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_compiles_fullgraph_without_recompiling_for_new_values(name):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q: q.dequantize() * 2, fullgraph=True, backend=counter)
    quantizer = TYPES[name]()
    for seed in range(2):
        x = torch.randn(64, 96, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        q = quantizer.quantize(x)  # a new tensor with new values (and, for delayed scaling, a moved history)
        assert type(q).__name__ == name
        assert torch.equal(compiled(q).nan_to_num(), (q.dequantize() * 2).nan_to_num())
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("copies", ["both", "rowwise", "columnwise"])
def test_the_inner_tensors_torch_compile_reads_are_the_tensors_buffers(name, copies):
    """__tensor_flatten__ names the inner tensors from the storages' plans (it runs at every call of
    a compiled graph): they are buffer_dict's buffers, each once, in its order, and the names and
    the context rebuild the same tensor."""
    q = TYPES[name]().quantize(torch.randn(64, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    if copies != "both":
        q = q.with_storages(q.rowwise if copies == "rowwise" else None, q.columnwise if copies == "columnwise" else None)
    buffers = q.buffer_dict(quantizer_state=False)
    names, context = q.__tensor_flatten__()
    assert names == [key.replace(".", "__") for key in buffers]
    assert all(getattr(q, name) is buffers[key] for name, key in zip(names, buffers))
    rebuilt = type(q).__tensor_unflatten__({n: getattr(q, n) for n in names}, context, q.shape, q.stride())
    assert torch.equal(rebuilt.dequantize().nan_to_num(), q.dequantize().nan_to_num())


KEPT_FLATTEN_CASES = {  # a shared tensor-wide buffer (Float8's scale_inv, NVFP4's global_amax), and none
    "Float8Tensor": lambda: qtensor.Float8Quantizer(),
    "NVFP4Tensor": lambda: qtensor.NVFP4Quantizer(),
    "HybridQuantizedTensor": TYPES["HybridQuantizedTensor"],
}


@pytest.mark.parametrize("name", list(KEPT_FLATTEN_CASES))
def test_the_kept_flatten_answer_follows_new_storages_unshared_buffers_and_quantizers(name):
    """Compiled code flattens each quantized input at every call, so the answer is kept on the tensor;
    it is made again when a storage is replaced, a shared buffer stops being shared or the quantizer
    changes: the names stay buffer_dict's, each read gives that buffer, the context the quantizer."""
    q = KEPT_FLATTEN_CASES[name]().quantize(torch.randn(64, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))

    def check():
        buffers = q.buffer_dict(quantizer_state=False)
        names, context = q.__tensor_flatten__()
        assert names == [key.replace(".", "__") for key in buffers]
        assert all(getattr(q, n) is buffers[key] for n, key in zip(names, buffers))
        assert context[1] is q.quantizer
        return names

    check()
    assert q.__tensor_flatten__() is q.__tensor_flatten__()  # kept between calls
    shared = q.shared_buffer_names()
    assert bool(shared) == (name != "HybridQuantizedTensor")
    for field in shared:  # no longer one tensor: named once per direction
        setattr(q.columnwise, field, getattr(q.columnwise, field).clone())
        assert field not in check() and f"columnwise__{field}" in check()
    q.rowwise = q.rowwise.map_buffers(torch.clone)
    check()
    q.columnwise = None
    assert not any(n.startswith("columnwise") for n in check())
    q.quantizer = KEPT_FLATTEN_CASES[name]()
    check()


def test_a_slice_compiles_and_keeps_its_format():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q: q[32:].dequantize(), fullgraph=True, backend=counter)
    q = qtensor.MXFP8Quantizer().quantize(torch.randn(64, 32))
    assert torch.equal(compiled(q), q.dequantize()[32:])


# ---- a quantize_'d model, compiled ------------------------------------------------------------------
import copy  # noqa: E402
import inspect  # noqa: E402

from torch import nn  # noqa: E402

STATELESS_RECIPES = ["float8_current", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd", "float8_rowwise", "float8_blockwise"]
RECIPES = [*STATELESS_RECIPES, "float8_delayed"]
DELAYED = ["float8_delayed", "hybrid_delayed"]


def _hybrid_delayed():
    """A user recipe: Float8 with delayed scaling rowwise (each child keeps its own history), MXFP8 columnwise."""
    delayed = lambda dtype: qtensor.Float8Quantizer(dtype, scaling="delayed", amax_history_len=16)
    return qtensor.recipes.ByTensorType(
        "hybrid_delayed",
        input=lambda: qtensor.HybridQuantizer(delayed(torch.float8_e4m3fn), qtensor.MXFP8Quantizer()),
        weight=lambda: qtensor.HybridQuantizer(delayed(torch.float8_e4m3fn), qtensor.MXFP8Quantizer()),
        grad_output=lambda: qtensor.HybridQuantizer(delayed(torch.float8_e5m2), qtensor.MXFP8Quantizer(torch.float8_e5m2)),
    )


def mlp(recipe, weights, override=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    factory = _hybrid_delayed() if recipe == "hybrid_delayed" else getattr(qtensor.recipes, recipe)()
    qtensor.quantize_(model, qtensor.Recipe(factory, backward_override=override), weights=weights)
    return model


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe", [*RECIPES, "hybrid_delayed"])
def test_a_quantized_model_compiles_without_graph_breaks(recipe, weights):
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(mlp(recipe, weights))(torch.randn(16, 64))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def _histories(model) -> list[torch.Tensor]:
    """Every layer's running state (delayed scaling's amax histories), copied."""
    return [
        buffer.clone()
        for module in model.modules()
        if isinstance(module, nn.Linear)
        for buffer in module.weight.linear_quantizers.state_buffers().values()
    ]


def _step(model, x, seed):
    torch.manual_seed(seed)  # stochastic rounding draws its keys from torch's generator
    out = model(x)
    out.float().square().sum().backward()
    grads = [out.detach(), *(p.grad.clone() for p in model.parameters())]
    with torch.no_grad():
        for p in model.parameters():  # plain SGD on the high-precision values (dynamic weights)
            if not isinstance(p, qtensor.QuantizedTensor):
                p -= 0.01 * p.grad
    model.zero_grad(set_to_none=True)
    return grads


TRAINING_CASES = [
    *[(recipe, override) for recipe in STATELESS_RECIPES for override in (None, "high_precision", "dequantized")],
    *[(recipe, None) for recipe in DELAYED],  # delayed scaling takes no backward override (qtensor.Recipe says why)
]


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe, override", TRAINING_CASES)
def test_compiled_training_matches_eager_and_does_not_recompile(recipe, weights, override):
    """Forward and backward through AOT autograd (the layer the tensor subclasses go through), three
    steps with new inputs and updated weights: the same outputs, gradients and amax histories as
    eager, one frame (a history that moves is a new input value, not a new graph)."""
    eager = mlp(recipe, weights, override)
    compiled_model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_model, backend=counter)
    for step in range(3):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
        for got, expected in zip(_step(compiled, x, step), _step(eager, x, step)):  # output, then gradients
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for got, expected in zip(_histories(compiled_model), _histories(eager), strict=True):
            assert torch.equal(got, expected)
    assert counter.frame_count == 1
    if recipe in DELAYED:  # the histories did move: three steps are in each one the casts used
        first, last = [m.weight.linear_quantizers for m in compiled_model.modules() if isinstance(m, nn.Linear)]
        # (The first layer's gradient makes no rowwise copy, for no dgrad: a hybrid's rowwise child
        # is never used there.)
        used = [first.input, last.input, last.grad_output]
        assert all(int((h >= 0).sum()) == 3 for q in used for h in q.state_buffers().values())



@pytest.mark.parametrize("recipe", ["float8_current", "mxfp8_fwd_nvfp4_bwd"])
def test_changing_a_quantizer_after_compiling_recompiles(recipe):
    """A compiled graph guards on the quantizers each weight carries (their configuration is kept
    between calls, the guard runs on every call): writing a quantizer's option afterwards makes the
    next call compile again, and its output is the eager model's with the same change."""
    eager = mlp(recipe, "dynamic")
    compiled_model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_model, backend=counter)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)
    before = compiled(x)
    for model in (eager, compiled_model):
        quantizer = model[0].weight.linear_quantizers.input.quantizer_for("rowwise")
        quantizer.fp8_dtype = torch.float8_e5m2  # an option every format here takes
    after = compiled(x)
    assert counter.frame_count == 2
    torch.testing.assert_close(after, eager(x), rtol=0, atol=0)
    assert not torch.equal(after, before)


@pytest.mark.parametrize("recipe", ["float8_current", "mxfp8_fwd_nvfp4_bwd"])
def test_a_held_weight_is_flattened_once_across_compiled_calls(recipe, monkeypatch):
    """Each compiled call flattens each quantized input and reads its inner tensors (guards and
    wrapper): a frozen held weight gives its kept answer, computed at the first call only, and its
    inner tensors are properties of its class (no __getattr__). New values written into the weight
    afterwards reach the compiled model, as the eager one."""
    eager = mlp(recipe, "quantized").requires_grad_(False)
    compiled_model = copy.deepcopy(eager)
    weight_class = type(compiled_model[0].weight)
    made = []
    flatten = weight_class._flatten
    monkeypatch.setattr(weight_class, "_flatten", lambda self, shared: made.append(self) or flatten(self, shared))
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend="aot_eager")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)
    made.clear()
    for _ in range(3):
        torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)
    assert made == []
    names, _ = compiled_model[0].weight.__tensor_flatten__()
    assert all(isinstance(inspect.getattr_static(weight_class, n), property) for n in names)
    new = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for model in (eager, compiled_model):
            model[0].weight.copy_(new)
    torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe", ["float8_current", "float8_delayed", "nvfp4"])
def test_compiled_codes_metadata_reads_and_probes_of_a_weight_skip_its_routing(recipe, weights, monkeypatch):
    """At every call, compiled code asks each quantized input for its size() and stride() (the
    wrapper) and probes it with hasattr for names such as `_dynamo_dynamic_indices` (the guards).
    These are answered as torch answers them, without the layer's routing or the inner-tensor
    lookup: `__getattr__` refuses a name that begins with "_" at once, and no inner tensor is read
    through it by such a name (a dynamic weight's `_data` is an attribute of its own)."""
    from qtensor.layers import routing
    from qtensor.layers.weight import LayerWeight

    model = mlp(recipe, weights)
    weight = model[0].weight
    x = torch.randn(16, 64)
    model(x).sum().backward()  # a delayed layer's running state exists from its first step
    names, _ = weight.__tensor_flatten__()
    assert names and all(name in vars(weight) for name in names if name.startswith("_"))
    if recipe == "float8_delayed":
        assert any(name.startswith("state__") for name in names)
    plain = torch.empty(weight.shape, dtype=weight.dtype)

    def refuse(*args, **kwargs):
        raise AssertionError(f"routed or looked up: {args[:2]}")

    monkeypatch.setattr(routing, "route", refuse)
    monkeypatch.setattr(routing, "torch_function", refuse)
    monkeypatch.setattr(LayerWeight, "_data_attribute", refuse)
    assert (weight.size(), weight.stride(), weight.shape, weight.dim()) == (plain.size(), plain.stride(), plain.shape, plain.dim())
    assert (weight.dtype, weight.device, weight.requires_grad, weight.ndim, weight.numel()) == (plain.dtype, plain.device, True, 2, plain.numel())
    for probe in ("_dynamo_dynamic_indices", "_dynamo_static_indices", "__missing__"):
        assert not hasattr(weight, probe)
    with pytest.raises(AttributeError, match="has no attribute '_dynamo_unbacked_indices'"):
        weight._dynamo_unbacked_indices


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe", ["float8_current", "float8_delayed", "mxfp8"])
def test_blocks_compiled_one_by_one_share_their_graphs_and_train_as_eager(recipe, weights):
    """torchtitan compiles each block of a model on its own. Identical quantized blocks differ only in
    their layers' names and running state, so they share one graph (two: the first block's input
    needs no gradient). Ten blocks would otherwise pass torch.compile's recompile limit (8) and the
    last ones would run eagerly. Three SGD steps end where the eager model's end."""
    torch.manual_seed(0)
    eager = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(10)])
    qtensor.quantize_(eager, getattr(qtensor.recipes, recipe)(), weights=weights)
    blocks = copy.deepcopy(eager)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for index, block in enumerate(blocks):
        blocks[index] = torch.compile(block, backend=counter, fullgraph=True)
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        for got, expected in zip(_step(blocks, x, step), _step(eager, x, step)):  # output, then gradients
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 2
    for got, expected in zip(blocks.state_dict().values(), eager.state_dict().values(), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


INDUCTOR_CASES = [
    "float8_current",
    pytest.param("mxfp8", marks=pytest.mark.xfail(
        torch.torch_version.TorchVersion(torch.__version__) < "2.13", strict=False,
        reason="torch 2.11's inductor fails a tiling assertion on MXFP8's reference cast on some CPUs (2.13 compiles it)",
    )),
    "nvfp4",
    "mxfp8_fwd_nvfp4_bwd",
    "float8_delayed",
]


@pytest.mark.parametrize("recipe", INDUCTOR_CASES)
def test_a_compiled_model_runs_under_inductor(recipe):
    """The default backend generates code for the quantized path's reference casts and GEMMs."""
    torch._dynamo.reset()
    eager = mlp(recipe, "dynamic")
    compiled = torch.compile(copy.deepcopy(eager))
    x = torch.randn(16, 64)
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.xfail(
    torch.torch_version.TorchVersion(torch.__version__) < "2.13", strict=False,
    reason="torch 2.11's inductor failed a tiling assertion on MXFP8's reference cast on the CPU (not re-checked there since the block-view rewrite)",
)
def test_mxfp8_forward_and_backward_compile_under_inductor_on_the_cpu(weights):
    """The backward casts the first layer's gradient both ways and dequantizes its columnwise copy in
    one fused CPU kernel (16 rows: one partial column block); the reference casts compile there and
    the compiled step equals eager: output, the input's gradient and the parameters' (docs/compile.md)."""
    eager = mlp("mxfp8", weights)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(eager), backend="inductor")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    results = []
    for model in (compiled, eager):
        x_leaf = x.clone().requires_grad_()  # a dgrad in the first layer too
        out = model(x_leaf)
        out.square().sum().backward()
        results.append([out.detach(), x_leaf.grad, *(p.grad for p in model.parameters())])
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

# The kernels each recipe's compiled graphs call as custom ops; the Float8 and MXFP8 casts, amaxes
# and dequantizes, and NVFP4's dequantize, are traced instead (qtensor/kernels.py, TRACED), so inductor fuses them.
CUSTOM_OPS = {
    "float8_current": set(),
    "mxfp8": set(),
    "nvfp4": {"qtensor.nvfp4_cast", "qtensor.nvfp4_amaxes", "qtensor.scale_output"},
    "mxfp8_fwd_nvfp4_bwd": {"qtensor.hybrid_cast", "qtensor.nvfp4_cast"},  # (its NVFP4 GEMMs have no bias: epilogue traced)
    "float8_delayed": {"qtensor.float8_record_amax"},
    "float8_rowwise": set(),
    "float8_blockwise": set(),
}
TRACED_OPS = {
    "qtensor.finite_amax", "qtensor.amax_partials", "qtensor.float8_cast", "qtensor.float8_cast_at_scale",
    "qtensor.float8_delayed_scale", "qtensor.float8_dequantize", "qtensor.mxfp8_cast", "qtensor.mxfp8_dequantize",
    "qtensor.nvfp4_dequantize",
}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_graphs_trace_the_fusable_casts_and_call_the_other_kernels(recipe, weights):
    """On CUDA the traced forward and backward hold the Float8 and MXFP8 casts as plain torch ops
    (for inductor to fuse) and call the other kernels as custom ops (qtensor_kernels/compiled.py),
    and the compiled step equals the eager one, which runs the Triton kernels (inductor, fp32)."""
    eager = mlp(recipe, weights).cuda()
    compiled_model = copy.deepcopy(eager)
    torch._dynamo.reset()
    recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
    x = torch.randn(64, 64, device="cuda")
    torch.manual_seed(3)
    torch.compile(compiled_model, backend=recorder)(x).square().sum().backward()
    code = "\n".join(g.code for g in recorder.fw_graphs + recorder.bw_graphs)
    missing = {op for op in CUSTOM_OPS[recipe] if op not in code}
    assert not missing, (missing, [line for line in code.splitlines() if "qtensor" in line or "copy_" in line])
    assert not {op for op in TRACED_OPS if f"{op}." in code}
    torch._dynamo.reset()
    inductor = torch.compile(copy.deepcopy(eager))
    # Optimizer steps between the steps: a new version of each weight each step, whose amax eager
    # records once and a compiled step records at its cast (docs/running-state.md).
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (eager, inductor)]
    if weights == "quantized":
        optimizers = [qtensor.optim.MasterWeights(optimizer) for optimizer in optimizers]
    for step in range(2):
        x = torch.randn(64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        torch.manual_seed(step)
        expected = eager(x)
        expected.square().sum().backward()
        torch.manual_seed(step)
        got = inductor(x)
        got.square().sum().backward()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for p_eager, p_compiled in zip(eager.parameters(), inductor.parameters()):
            torch.testing.assert_close(p_compiled.grad, p_eager.grad, rtol=1e-5, atol=1e-5)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    # Delayed scaling: the compiled steps moved the histories on the GPU, as the eager ones.
    # (An eager layer leaves a history it never used where quantize_ made it, on the CPU.)
    for got, expected in zip(_histories(inductor), _histories(eager), strict=True):
        assert got.device.type == "cuda"
        torch.testing.assert_close(got, expected.to(got.device), rtol=1e-5, atol=0)




@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_graphs_train_as_eager_and_update_delayed_scaling_inside_the_graph(recipe):
    """torch.compile(mode="reduce-overhead") replays the step as CUDA graphs (inductor does not skip
    them: no "skipping cudagraphs" warning), and three training steps with optimizer steps between
    them equal eager's: outputs, gradients, and delayed scaling's histories, which the replayed
    graphs update."""
    import logging

    from torch._inductor.cudagraph_utils import cudagraphs_log

    eager = mlp(recipe, "dynamic").cuda()
    graphed_model = copy.deepcopy(eager)
    torch._dynamo.reset()
    graphed = torch.compile(graphed_model, mode="reduce-overhead")
    skips, handler = [], logging.Handler()
    handler.emit = lambda record: skips.append(record.getMessage())
    cudagraphs_log.addHandler(handler)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (eager, graphed_model)]
    try:
        for step in range(4):  # the first calls record the graphs, the later ones replay them
            x = torch.randn(64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            torch.manual_seed(step)
            expected = eager(x)
            expected.square().sum().backward()
            torch.compiler.cudagraph_mark_step_begin()
            torch.manual_seed(step)
            got = graphed(x)
            got.square().sum().backward()
            torch.testing.assert_close(got.clone(), expected, rtol=1e-5, atol=1e-5)
            for p_eager, p_graphed in zip(eager.parameters(), graphed_model.parameters()):
                torch.testing.assert_close(p_graphed.grad, p_eager.grad, rtol=1e-5, atol=1e-5)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    finally:
        cudagraphs_log.removeHandler(handler)
    assert not skips, skips
    for got, expected in zip(_histories(graphed_model), _histories(eager), strict=True):
        torch.testing.assert_close(got, expected.to(got.device), rtol=1e-5, atol=0)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_delayed_scaling_updates_its_histories_in_place_inside_the_compiled_step(weights):
    """The histories are inputs of the compiled graphs, written in place: a training step writes them
    in its backward (forward and backward of one step cannot both write one input); an inference
    forward writes nothing (docs/running-state.md); no graph writes anything else (no copy of a
    weight's values)."""
    model = mlp("float8_delayed", weights)
    casts_per_forward = 2 if weights == "dynamic" else 1  # the input's, and a dynamic weight's
    layers = 2
    torch._dynamo.reset()
    recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
    compiled = torch.compile(model, backend=recorder)
    compiled(torch.randn(16, 64)).sum().backward()
    with torch.no_grad():
        compiled(torch.randn(16, 64))
    training_forward, inference_forward = recorder.fw_graphs
    (training_backward,) = recorder.bw_graphs
    writes = lambda graph: graph.code.count("torch.ops.aten.copy_.default(")
    assert writes(training_forward) == 0
    assert writes(training_backward) == layers * (casts_per_forward + 1)  # and the gradient's
    assert writes(inference_forward) == 0

    # And the same histories and outputs as eager after a training step and an inference forward.
    eager, fresh = mlp("float8_delayed", weights), mlp("float8_delayed", weights)
    compiled = torch.compile(fresh, backend="aot_eager")
    x, x_eval = torch.randn(16, 64), torch.randn(16, 64)
    for model_ in (eager, compiled):
        model_(x).sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x_eval), eager(x_eval), rtol=1e-5, atol=1e-5)
    for got, expected in zip(_histories(fresh), _histories(eager), strict=True):
        assert torch.equal(got, expected)


def test_eager_backward_records_into_the_history_the_quantizer_holds_then():
    """A history replaced between forward and backward (moved to the weight's device when the
    compiler or a saved-tensor hook reads the weight) takes the backward's record: nothing the
    compiled path binds leaks into eager steps."""
    model = mlp("float8_delayed", "quantized")
    out = model(torch.randn(16, 64))
    layers = [m.weight.linear_quantizers for m in model.modules() if isinstance(m, nn.Linear)]
    for layer in layers:
        layer.grad_output.amax_history = layer.grad_output.amax_history.clone()  # as a move does
    out.sum().backward()
    assert all(int((layer.grad_output.amax_history >= 0).sum()) == 1 for layer in layers)


class _Checkpointed(nn.Module):
    """Two quantized layers recomputed in the backward (torch.utils.checkpoint, non-reentrant)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 32)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(lambda t: self.b(nn.functional.gelu(self.a(t))), x, use_reentrant=False)


@pytest.mark.parametrize("weights", ["dynamic", "quantized"])
def test_delayed_scaling_compiles_with_activation_checkpointing(weights):
    """The recomputed forward inside the compiled step neither casts at another scale nor records a
    second time: outputs, gradients and histories equal eager's, step after step."""
    torch.manual_seed(0)
    eager = _Checkpointed()
    qtensor.quantize_(eager, qtensor.recipes.float8_delayed(), weights=weights)
    compiled_model = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend="aot_eager")
    for step in range(3):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step), requires_grad=True)
        for got, expected in zip(_step(compiled, x, step), _step(eager, x, step)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for got, expected in zip(_histories(compiled_model), _histories(eager), strict=True):
            assert torch.equal(got, expected)


def _cache_key_bytes(weight, mode) -> bytes:
    """What torch.compile's caches (AOTAutograd, inductor's FX graph cache) pickle of a traced
    input to key the code compiled for it."""
    from torch._inductor.codecache import FxGraphCachePickler

    return FxGraphCachePickler(torch.fx.GraphModule(nn.Module(), torch.fx.Graph())).dumps(weight)


def test_the_compile_caches_key_a_traced_weight_by_its_inner_tensors():
    """A traced layer weight whose inner tensors differ from another's (a weight FSDP2 gathered
    from a dynamic weight's shard carries that cast's amaxes, which its compiled step records; a
    quantized weight's does not) must not share a key in the compile caches: code compiled for one
    takes a different number of inputs than the other gives it (on 2 GPUs: `not enough values to
    unpack (expected 17, got 15)`). Two weights alike share their key, so the caches still serve them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qtensor.layers.weight import GatheredCast

    mode = FakeTensorMode()
    traced = []
    for _ in range(3):
        torch.manual_seed(0)
        layer = nn.Linear(64, 64)
        qtensor.quantize_(layer, qtensor.recipes.float8_delayed(), weights="quantized")
        traced.append(mode.from_tensor(layer.weight))
    assert _cache_key_bytes(traced[0], mode) == _cache_key_bytes(traced[1], mode)
    traced[2].gathered_cast = GatheredCast()
    traced[2].gathered_cast.notes = [(traced[2].linear_quantizers.weight, mode.from_tensor(torch.zeros(4)))]
    assert len(traced[2].__tensor_flatten__()[0]) == len(traced[0].__tensor_flatten__()[0]) + 1
    assert _cache_key_bytes(traced[2], mode) != _cache_key_bytes(traced[0], mode)
