"""LoRA fine-tuning over a frozen base: peak memory and tokens/s by the base's format (GPU).

    python benchmarks/bench_lora.py [--systems bf16,float8_rowwise,nvfp4,nf4] [--steps 10] [--seq 2048]
                                    [--batch 1] [--checkpointing] [--compile [--cuda-graphs] [--skip-guards]] [--chunked-loss N] [--tiny]

A Llama-shaped model of about 1.1B parameters (hidden 2048, 22 blocks, MLP 5632, 32 heads, 4 KV
heads, vocabulary 32000; random weights) in bf16, its blocks' linear weights then held in the
base's format, LoRA rank 16 (alpha 32) on every linear layer of the blocks (peft), sequence 2048,
batch 1, bf16 autocast, AdamW on the adapters. A step is forward,
backward and the optimizer step; the median of `--steps` after two warm-up steps. Systems:

- "bf16": the base in bf16;
- "<recipe>": the base held quantized by qtensor (`weights="quantized"`), e.g. float8_rowwise, nvfp4;
- "nvfp4 weight-only": `recipes.nvfp4(weight_only=True)`, NVFP4 weights and bf16 activations
  (W4A16, as NF4); "one-copy" may follow;
- "<recipe> one-copy": the same, each frozen weight then keeping the forward's copy only
  (`qtensor.keep_forward_copies_`: formats that rebuild dgrad's copy from it, per-tensor FP8,
  128×128 FP8 blocks, NVFP4's 16×16 tiles);
- "nf4": torchao's NF4 (`to_nf4`) for every block's linear weights, as torchtune's QLoRA holds
  them (where torchao imports);
- "bnb_nf4": bitsandbytes' NF4 (`Linear4bit`, double-quantized scales, bf16 compute) for every
  block's linear layer, as transformers' `BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)` loads a QLoRA base (where
  bitsandbytes imports); peft then wraps them with its own bitsandbytes LoRA layers.

`--checkpointing` recomputes each block's activations in the backward (transformers' gradient
checkpointing, non-reentrant), for every system; `--compile` compiles each block
(`torch.compile`), and with `--cuda-graphs` replays each compiled block as CUDA graphs
(`mode="reduce-overhead"`: the host launches a block's kernels in one call); `--skip-guards` then
times the steps without the compiled blocks' guards (`torch.compiler.set_stance("default",
skip_guard_eval_unsafe=True)`, for a loop that repeats the warm-up's shapes). `--tiny` runs a two-block model of width 256 (on the CPU too, `--device
cpu`) to check the script. `--chunked-loss N` computes the loss over N chunks of the sequence, each
chunk's logits made by the head and consumed by the cross-entropy inside an activation checkpoint
(`chunked_loss`): no [tokens, vocabulary] logits are kept for the backward, or ever whole in fp32
(the memory-saving losses of torchtune and Liger do the same), for every system alike; by default
the model computes its own loss (transformers', over the whole logits upcast to fp32). Prints tokens/s, × bf16 and peak GiB per system, and the bytes a forward saves for the backward
per token (activations: every tensor autograd saves, less the model's parameters and the held
weights' own buffers; measured with saved-tensor hooks, so on the CPU too).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time

import torch
import torch.utils.checkpoint
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qtensor  # noqa: E402

SHAPES = {
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4),
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}


def build(system: str, shape: str, device: str, checkpointing: bool = False, compiled: bool | str = False):
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model.to(torch.bfloat16)  # every base in bf16 (embeddings, norms, the head), its blocks' linear weights then quantized
    if system == "nf4":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        for layer in model.model.layers:
            for module in layer.modules():
                if isinstance(module, nn.Linear):
                    module.weight = nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
    elif system == "bnb_nf4":
        _to_bnb_nf4(model.model.layers, device)
    elif system != "bf16":
        options = {"weight_only": True} if "weight-only" in system.split() else {}
        qtensor.quantize_(model.model.layers, getattr(qtensor.recipes, system.split()[0])(**options), weights="quantized")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0))
    if "one-copy" in system:
        qtensor.keep_forward_copies_(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled:  # each block compiled on its own (as torchtune and torchtitan compile theirs)
        for layer in model.base_model.model.model.layers:
            layer.compile(**({"mode": compiled} if isinstance(compiled, str) else {}))
    return model


def _to_bnb_nf4(blocks: nn.Module, device: str) -> None:
    """Every nn.Linear under `blocks` replaced by bitsandbytes' NF4 Linear4bit over its weight."""
    import bitsandbytes as bnb

    for block in blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:
                    continue
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4", device="meta")
                # Params4bit quantizes as it moves to the device (from the CPU: the cast happens there).
                layer.weight = bnb.nn.Params4bit(child.weight.detach().cpu(), requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True, blocksize=64).to(device)
                if child.bias is not None:
                    layer.bias = nn.Parameter(child.bias.detach(), requires_grad=False)
                setattr(parent, name, layer)


def chunked_loss(model, tokens: torch.Tensor, chunks: int) -> torch.Tensor:
    """The model's next-token loss (mean cross-entropy over the shifted labels, as transformers' own),
    from its last hidden states in `chunks` pieces of the sequence: each piece's logits made by the
    head and consumed by the loss in an activation checkpoint, so that only the hidden states are
    kept for the backward and one piece's logits exist at a time."""
    causal_lm = model.get_base_model()
    hidden = causal_lm.model(input_ids=tokens).last_hidden_state[:, :-1]
    labels = tokens[:, 1:]

    def piece(h, y):
        return nn.functional.cross_entropy(causal_lm.lm_head(h).float().flatten(0, 1), y.flatten(), reduction="sum")

    total = sum(torch.utils.checkpoint.checkpoint(piece, h, y, use_reentrant=False) for h, y in zip(hidden.chunk(chunks, 1), labels.chunk(chunks, 1)))
    return total / labels.numel()


def measure(system: str, shape: str, device: str, seq: int, steps: int, checkpointing: bool = False, compiled: bool | str = False, batch: int = 1,
            chunks: int = 0, skip_guards: bool = False) -> dict:
    model = build(system, shape, device, checkpointing, compiled)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=device == "cuda")
    tokens = torch.randint(0, SHAPES[shape]["vocab_size"], (batch, seq), device=device)

    def loss_of(tokens):
        return chunked_loss(model, tokens, chunks) if chunks else model(input_ids=tokens, labels=tokens).loss

    def step():
        if compiled == "reduce-overhead":  # a new step for the CUDA graphs' memory pool (torch's advice for training loops)
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_of(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    own = {t.untyped_storage().data_ptr() for p in model.parameters() for t in _buffers(p)}
    saved = {}

    def keep(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            for t in _buffers(tensor):
                pointer = t.untyped_storage().data_ptr()
                if pointer not in own:
                    saved[pointer] = t.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), torch.autocast(device, dtype=torch.bfloat16):
        loss = loss_of(tokens)
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    saved_per_token = sum(saved.values()) / (batch * seq)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        step()
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    # The timed steps, with --skip-guards, without the compiled blocks' guards: the warm-up compiled
    # every block, and the steps repeat its inputs' shapes and kinds (torch's stance for steady state).
    stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if skip_guards else contextlib.nullcontext()
    with stance:
        for _ in range(steps):
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return {"tokens_per_s": batch * seq / seconds, "ms": seconds * 1e3, "peak_gib": peak, "saved_per_token": saved_per_token}


def _buffers(tensor):
    """The plain tensors holding `tensor`'s bytes: a quantized tensor's storage buffers (both
    directions), an NF4 tensor's inner tensors, or the tensor itself."""
    if hasattr(tensor, "rowwise") and hasattr(tensor, "columnwise"):
        return [b for d in ("rowwise", "columnwise") if getattr(tensor, d) is not None for b in getattr(tensor, d).buffers.values()]
    if type(tensor).__name__ == "NF4Tensor":
        names, _ = tensor.__tensor_flatten__()
        return [getattr(tensor, name) for name in names]
    if type(tensor) is not torch.Tensor and not isinstance(tensor, nn.Parameter):
        return []  # another subclass (a dynamic weight): its bytes are the parameter's
    return [tensor]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="bf16,float8_current,float8_rowwise,mxfp8,nvfp4,nf4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of every block")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--cuda-graphs", action="store_true", help="with --compile: mode='reduce-overhead' (CUDA graphs)")
    parser.add_argument("--skip-guards", action="store_true", help="with --compile: the timed steps skip the compiled blocks' guards")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--chunked-loss", type=int, default=0, metavar="N", help="the loss over N chunks of the sequence, logits recomputed")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    shape = "tiny" if args.tiny else "1b"
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    compiled = "reduce-overhead" if args.compile and args.cuda_graphs else args.compile
    options = (", gradient checkpointing" if args.checkpointing else "") + (", blocks compiled" if args.compile else "") + (" as CUDA graphs" if compiled == "reduce-overhead" else "")
    options += f", loss in {args.chunked_loss} chunks" if args.chunked_loss else ""
    options += ", guards skipped in the timed steps" if args.skip_guards and args.compile else ""
    print(f"{name}, torch {torch.__version__}; LoRA r16 over a {shape} Llama, batch {args.batch} of sequence {args.seq}{options}, median of {args.steps} steps")
    print(f"{'system':<24} {'tokens/s':>10} {'ms':>9} {'x bf16':>7} {'peak GiB':>9} {'saved KiB/token':>16}")
    base = None
    for system in args.systems.split(","):
        try:
            row = measure(system, shape, args.device, args.seq, args.steps, args.checkpointing, compiled, args.batch, args.chunked_loss, args.skip_guards)
        except Exception as error:  # one system's failure is a row
            print(f"{system:<24} failed: {type(error).__name__}: {str(error)[:160]}", flush=True)
            continue
        base = base or (row["tokens_per_s"] if system == "bf16" else None)
        ratio = f"{row['tokens_per_s'] / base:7.2f}" if base else f"{'-':>7}"
        print(f"{system:<24} {row['tokens_per_s']:>10,.0f} {row['ms']:>9.1f} {ratio} {row['peak_gib']:>9.2f} {row['saved_per_token'] / 1024:>16.1f}", flush=True)
        if compiled:  # frees the compiled blocks and their CUDA graphs' memory pools: each system's peak is its own
            torch._dynamo.reset()
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
