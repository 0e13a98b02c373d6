"""Write the files tests/test_legacy_files.py loads: what qtensor wrote before a change of its
layout, kept so later code is checked against them (run from the repository root with the code
of the commit the files should come from: `python tests/legacy/make_files.py tests/legacy/<name>`).

Through the public API only: whole-model pickles (`torch.save(model)`, `pickle`), a state_dict
loadable with `weights_only=True`, `qtensor.save_model`, a torch.distributed.checkpoint directory,
and a Hugging Face `save_pretrained` directory. Beside them, `expected.pt` holds each model's
output on a fixed input, computed by the code that wrote the files.
"""

import os
import pickle
import sys

import torch
from torch import nn

import qtensor
import qtensor.hf

CASES = {  # name -> (recipe, weights); one per kind of state a file can carry
    "float8_delayed_dynamic": (qtensor.recipes.float8_delayed(), "dynamic"),  # running state
    "mxfp8_quantized": (qtensor.recipes.mxfp8(), "quantized"),
    "nvfp4_quantized": (qtensor.recipes.nvfp4(), "quantized"),
    "hybrid_dynamic": (qtensor.recipes.mxfp8_fwd_nvfp4_bwd(), "dynamic"),
}


def model_of(recipe, weights):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    qtensor.quantize_(model, recipe, weights=weights)
    return model


def trained(model):
    """Two steps, so delayed scaling's histories hold something."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if any(isinstance(p, qtensor.QuantizedTensor) for p in model.parameters()):
        optimizer = qtensor.optim.MasterWeights(optimizer)
    for step in range(2):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def main(folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    probe = torch.randn(16, 64, generator=torch.Generator().manual_seed(7))
    expected = {}
    for name, (recipe, weights) in CASES.items():
        model = trained(model_of(recipe, weights))
        with torch.no_grad():
            expected[name] = model(probe)
        torch.save(model, os.path.join(folder, f"{name}.module.pt"))
        with open(os.path.join(folder, f"{name}.module.pickle"), "wb") as file:
            pickle.dump(model, file)
        torch.save(model.state_dict(), os.path.join(folder, f"{name}.state_dict.pt"))
        qtensor.save_model(model, os.path.join(folder, f"{name}.safetensors"))
        import torch.distributed.checkpoint as dcp

        dcp.save(model.state_dict(), checkpoint_id=os.path.join(folder, f"{name}.dcp"))
    # A save_pretrained directory of a tiny Llama loaded with a QTensorConfig.
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    plain_dir = os.path.join(folder, "_plain_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(plain_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        plain_dir, quantization_config=qtensor.hf.QTensorConfig(recipe="mxfp8", weights="quantized")
    )
    model.save_pretrained(os.path.join(folder, "llama_mxfp8_quantized"))
    tokens = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        expected["llama_mxfp8_quantized"] = model(tokens).logits
    import shutil

    shutil.rmtree(plain_dir)
    torch.save(expected, os.path.join(folder, "expected.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
