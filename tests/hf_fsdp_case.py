"""A worker of tests/test_hf_fsdp.py: `save_pretrained` of a model sharded by FSDP2 (2 gloo ranks; with
QTENSOR_TEST_DEVICE=cuda, NCCL and one GPU a rank). For each weight mode, a tiny Llama loaded through
`QTensorConfig(recipe="float8_current")` is sharded (each decoder layer, then the root) and takes one
training step; every rank then calls `save_pretrained(dir, is_main_process=rank == 0)`. The
reference is the same model trained by the same step in one process, unsharded. Rank 0 loads the
directory with `from_pretrained` in this one process and saves, per weight mode: the reference's and
the reloaded model's logits and parameters, both runs' losses, and what `state_for_writer` gave each
rank."""

import copy
import os

import torch
import torch.distributed as dist

import qtensor
import qtensor.hf
from workers import worker_main

DEVICE = os.environ.get("QTENSOR_TEST_DEVICE", "cpu")
WEIGHTS = ("dynamic", "quantized")


def plain_checkpoint(folder):
    """A tiny plain Llama (hidden 64, 2 layers) written by rank 0."""
    import transformers

    if dist.get_rank() == 0:
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    dist.barrier()


def step(model, tokens):
    """One SGD step (through MasterWeights for quantized weights); the loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if any(isinstance(getattr(p, "_local_tensor", p), qtensor.QuantizedTensor) for p in model.parameters()):
        optimizer = qtensor.optim.MasterWeights(optimizer)
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def values(model) -> dict:
    """Every parameter as what a round trip must keep: a quantized one's buffers, else its values."""
    found = {}
    for name, p in model.named_parameters():
        if isinstance(p, qtensor.QuantizedTensor):
            found.update({f"{name}.{b}": t.detach().cpu().clone() for b, t in p.to_buffers()[0].items()})
        else:
            found[name] = (p.plain() if hasattr(p, "plain") else p).detach().cpu().clone()
    return found


def run(out):
    import transformers
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    rank = dist.get_rank()
    device = torch.device(DEVICE, rank) if DEVICE == "cuda" else torch.device("cpu")
    if DEVICE == "cuda":
        torch.cuda.set_device(device)
    folder = os.path.dirname(out)
    plain = os.path.join(folder, "plain")
    plain_checkpoint(plain)
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    results = {}
    for weights in WEIGHTS:
        config = qtensor.hf.QTensorConfig(recipe="float8_current", weights=weights)
        model = transformers.AutoModelForCausalLM.from_pretrained(plain, quantization_config=config).to(device)
        reference, initial = copy.deepcopy(model), values(model)  # the same weights, trained in one process
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        sharded_loss, single_loss = step(model, tokens), step(reference, tokens)
        stored, _ = qtensor.checkpoint.state_for_writer(model)  # what save_pretrained takes, on each rank
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, len(stored))
        saved = os.path.join(folder, f"saved_{weights}")
        model.save_pretrained(saved, is_main_process=rank == 0, max_shard_size="100KB")  # every rank: a collective
        dist.barrier()
        if rank == 0:
            loaded = transformers.AutoModelForCausalLM.from_pretrained(saved).to(device)
            with torch.no_grad():
                logits = {"loaded": loaded(tokens).logits.cpu(), "reference": reference(tokens).logits.cpu()}
            results[weights] = dict(
                losses=(sharded_loss, single_loss), logits=logits, loaded=values(loaded), reference=values(reference), initial=initial,
                counts=counts, files=sorted(os.listdir(saved)), tokens=tokens.cpu(),
                types={n: type(p).__name__ for n, p in loaded.named_parameters()},
            )
        dist.barrier()
    if rank == 0:
        torch.save(results, out)
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker_main(run)
