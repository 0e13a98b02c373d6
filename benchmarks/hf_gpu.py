"""qtensor.hf on a GPU: peak memory of from_pretrained with a QTensorConfig, and the fine-grained
FP8 export read back by transformers' own FP8 layers (docs/huggingface.md).

    python benchmarks/hf_gpu.py [--out DIR]

1. Peak GPU memory (torch.cuda.max_memory_allocated) of loading a bf16 Llama-shaped checkpoint
   onto the GPU (device_map="cuda"): plain; loaded then quantize_'d by hand; and through
   QTensorConfig, which casts each weight as it loads. Each in a fresh process.
2. The same checkpoint quantized both ways holds the same bytes (the GPU cast kernels on both paths).
3. export(fp8=True) of float8_blockwise and float8_rowwise models, loaded by from_pretrained on the
   GPU: its FP8 layers hold qtensor's bytes, and their logits are compared with qtensor's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

BIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
           num_key_value_heads=16, max_position_embeddings=256, tie_word_embeddings=False)
SMALL = dict(BIG, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8)


def _llama(path: str, shape: dict) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).to(torch.bfloat16)
    model.save_pretrained(path)


def peak(path: str, how: str, recipe: str) -> dict:
    """Run in a fresh process: load `path` onto the GPU `how` and report the peak."""
    import transformers

    import qtensor
    import qtensor.hf

    torch.cuda.reset_peak_memory_stats()
    if how == "plain":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    elif how == "by_hand":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
        qtensor.quantize_(model, getattr(qtensor.recipes, recipe)(), weights="quantized")
    else:
        config = qtensor.hf.QTensorConfig(recipe=recipe, weights="quantized")
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda", quantization_config=config)
    torch.cuda.synchronize()
    return {"how": how, "recipe": recipe, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "held_gib": torch.cuda.memory_allocated() / 2**30}


def same_bytes(path: str, recipe: str) -> bool:
    import transformers

    import qtensor
    import qtensor.hf

    by_hand = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    qtensor.quantize_(by_hand, getattr(qtensor.recipes, recipe)(), weights="quantized")
    config = qtensor.hf.QTensorConfig(recipe=recipe, weights="quantized")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda", quantization_config=config)
    a, _ = qtensor.checkpoint.state_for_writer(by_hand)
    b, _ = qtensor.checkpoint.state_for_writer(loaded)
    return a.keys() == b.keys() and all(torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)) for k in a)


def fp8_export(path: str, recipe: str) -> dict:
    import transformers

    import qtensor
    import qtensor.hf

    config = qtensor.hf.QTensorConfig(recipe=recipe, weights="quantized")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda", quantization_config=config)
    out = tempfile.mkdtemp()
    qtensor.hf.export(model, out, fp8=True)
    served = transformers.AutoModelForCausalLM.from_pretrained(out, device_map="cuda")
    layer = "model.layers.0.mlp.down_proj"
    kind = type(served.get_submodule(layer)).__name__
    same = all(
        torch.equal(served.get_submodule(name).weight.view(torch.uint8), model.get_submodule(name).weight.rowwise.data.view(torch.uint8))
        for name in model.qtensor_report.quantized
    )
    tokens = torch.randint(32000, (2, 256), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        ours, theirs = model(tokens).logits.float(), served(tokens).logits.float()
    return {"recipe": recipe, "layer_type": kind, "same_fp8_bytes": same,
            "logits_rel_diff": ((ours - theirs).norm() / ours.norm()).item(),
            "top1_agree": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--child", nargs=3, metavar=("PATH", "HOW", "RECIPE"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(peak(*args.child)))
        return
    big, small = tempfile.mkdtemp(), tempfile.mkdtemp()
    _llama(big, BIG)
    _llama(small, SMALL)
    rows = []
    for how, recipe in [("plain", "-"), ("by_hand", "nvfp4"), ("qtensor_config", "nvfp4"),
                        ("by_hand", "float8_blockwise"), ("qtensor_config", "float8_blockwise")]:
        result = subprocess.run([sys.executable, __file__, "--child", big, how, recipe], capture_output=True, text=True)
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else {"how": how, "recipe": recipe, "error": result.stderr[-1500:]})
    checks = {recipe: same_bytes(small, recipe) for recipe in ("nvfp4", "float8_blockwise", "float8_delayed")}
    exports = []
    for recipe in ("float8_blockwise", "float8_rowwise", "float8_current"):
        try:
            exports.append(fp8_export(small, recipe))
        except Exception as error:  # report what transformers' FP8 layers could not do
            exports.append({"recipe": recipe, "error": f"{type(error).__name__}: {error}"[:1500]})
    report = {"device": torch.cuda.get_device_name(), "model": BIG, "peaks": rows, "same_bytes": checks, "fp8_export": exports}
    with open(os.path.join(args.out, "hf_gpu.json"), "w") as file:
        json.dump(report, file, indent=1)
    print("| load (bf16 checkpoint, 1.2B Llama) | recipe | peak GiB | held GiB |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['how']} | {row['recipe']} | {row.get('peak_gib', float('nan')):.2f} | {row.get('held_gib', float('nan')):.2f} |" if "error" not in row else f"| {row['how']} | {row['recipe']} | error: {row['error'][-300:]} |")
    print("same bytes as quantize_ by hand on the GPU:", checks)
    for row in exports:
        print("fp8 export:", row)


if __name__ == "__main__":
    main()
