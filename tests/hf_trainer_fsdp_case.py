"""A worker of tests/test_hf_fsdp.py, on 2 GPUs only (accelerate applies FSDP to GPUs alone; on CPUs it
runs DDP): `QTensorTrainer.save_model` of a model sharded by FSDP2, as a training script calls it, on
every rank. For each weight mode, the tiny Llama of hf_fsdp_case.py is given to a `QTensorTrainer` whose
arguments ask for FSDP2 (`fsdp_config={"version": 2}`, the full state dict `Trainer` saves by
default), sharded with `fully_shard` as accelerate shards it (each decoder layer, then the root) and
trained one step by hand: `QTensorTrainer.train` refuses FSDP2 (accelerate maps the optimizer's
parameters to the shards by `data_ptr()`, which qtensor's weights, tensors without storage of their
own, do not give). The reference is the trained parameters gathered rank by rank with `all_gather`
(dequantized shards, plain values) and the sharded model's own logits. Rank 0 loads the directory
with `from_pretrained` in this one process and saves both."""

import os

import torch
import torch.distributed as dist

import qtensor
import qtensor.hf
from hf_fsdp_case import plain_checkpoint, step
from workers import worker_main

WEIGHTS = ("dynamic", "quantized")


def gathered(model) -> dict:
    """Each parameter's whole values, gathered from the ranks' shards by all_gather (not by qtensor's
    gather, which save_pretrained uses): a quantized shard dequantized first."""
    found = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        local = local.dequantize() if isinstance(local, qtensor.QuantizedTensor) else (local.plain() if hasattr(local, "plain") else local)
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, local.detach().contiguous())
        found[name] = torch.cat(pieces)[: p.shape[0]].cpu()
    return found


def plain_values(model) -> dict:
    found = {}
    for name, p in model.named_parameters():
        value = p.dequantize() if isinstance(p, qtensor.QuantizedTensor) else (p.plain() if hasattr(p, "plain") else p)
        found[name] = value.detach().cpu()
    return found


def run(out):
    import transformers
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # accelerate reads it
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    folder = os.path.dirname(out)
    plain = os.path.join(folder, "plain")
    plain_checkpoint(plain)
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(1)).cuda()
    results = {}
    for weights in WEIGHTS:
        config = qtensor.hf.QTensorConfig(recipe="float8_current", weights=weights)
        model = transformers.AutoModelForCausalLM.from_pretrained(plain, quantization_config=config).cuda()
        args = transformers.TrainingArguments(
            os.path.join(folder, f"run_{weights}"), report_to=[], disable_tqdm=True,
            fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        )
        trainer = qtensor.hf.QTensorTrainer(model=model, args=args)
        assert trainer.is_fsdp_enabled and "FULL_STATE_DICT" in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)
        try:
            trainer.train()
            refused = ""
        except ValueError as error:
            refused = str(error)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        step(model, tokens)
        reference = gathered(model)
        with torch.no_grad():
            sharded_logits = model(tokens).logits.cpu()
        saved = os.path.join(folder, f"saved_{weights}")
        trainer.save_model(saved)  # every rank, as a training script calls it
        dist.barrier()
        if rank == 0:
            loaded = transformers.AutoModelForCausalLM.from_pretrained(saved).cuda()
            with torch.no_grad():
                logits = {"sharded": sharded_logits, "loaded": loaded(tokens).logits.cpu()}
            results[weights] = dict(
                refused=refused, reference=reference, loaded=plain_values(loaded), logits=logits,
                types={n: type(p).__name__ for n, p in loaded.named_parameters()}, files=sorted(os.listdir(saved)),
            )
        dist.barrier()
    if rank == 0:
        torch.save(results, out)
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker_main(run)
