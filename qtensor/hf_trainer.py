"""`QTensorTrainer`: `transformers.Trainer` for models quantized by qtensor (docs/huggingface.md,
docs/fine-tuning.md), as `qtensor.hf.QTensorTrainer`. Its own module, imported at its first use:
`transformers.Trainer` imports peft where it is installed (qtensor/hf.py says why that matters)."""

from __future__ import annotations

import os

import torch
from transformers import Trainer

from . import checkpoint, hf_files, hf_schedule
from .hf_files import RUNNING_STATE_FILE, checkpoint_files
from .core.tensor import QuantizedTensor
from .optim import MasterWeights
from .quantize import is_qtensor_quantizer, keep_forward_copies_, running_state


class QTensorTrainer(Trainer):
    """`transformers.Trainer` for a model `from_pretrained` quantized with a `QTensorConfig`:

    - with quantized weights (`weights="quantized"`), the optimizer `Trainer` builds
      (`create_optimizer`, the documented hook) is wrapped in `qtensor.optim.MasterWeights`, which
      steps high-precision masters and writes them back into the quantized weights;
    - `train(resume_from_checkpoint=...)` restores the checkpoint's qtensor tensors (quantized
      weights' bytes, delayed scaling's histories) with `qtensor.checkpoint.load_model_files`,
      where `Trainer`'s own `load_state_dict` of the file's plain tensors would leave them out,
      and restores them again after `MasterWeights`' state (whose loading casts the masters);
    - a peft model (adapters over a frozen quantized base, docs/fine-tuning.md) checkpoints its
      adapters as peft saves them, and beside them the base's running state (delayed scaling's
      input and gradient histories, `qtensor_running_state.safetensors`), which a resumed run
      restores: the frozen base itself is the one the run loaded;
    - as training starts (`create_optimizer`), each frozen held weight keeps only the forward's
      copy where its format rebuilds dgrad's from it (`qtensor.keep_forward_copies_`: a LoRA
      base's weights at half their bytes, training bit for bit as over both copies); what each
      kept is in `kept_copies`. `keep_forward_copies=False` keeps both.

    Anything else is `Trainer`'s own. A model with dynamic weights also trains with a plain
    `Trainer`, but resumes exactly only here."""

    def __init__(self, *args, keep_forward_copies: bool = True, **kwargs):
        self.keep_forward_copies = keep_forward_copies
        self.kept_copies: dict[str, str] = {}
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        target = model if model is not None else self.model
        trained = [p for p in target.parameters() if p.requires_grad]  # (a peft model's frozen base has no masters)
        if any(isinstance(p, QuantizedTensor) for p in trained) and not isinstance(optimizer, MasterWeights):
            self.optimizer = optimizer = MasterWeights(optimizer)
        if self.keep_forward_copies:
            # Here, as training starts: the base is frozen by now (peft's get_peft_model, or the caller), and a
            # resumed run has loaded its checkpoint (a refused resume leaves the base as it was).
            self.kept_copies = keep_forward_copies_(self.accelerator.unwrap_model(target, keep_torch_compile=False))
        return optimizer

    def train(self, *args, **kwargs):
        """`Trainer.train`, refused under accelerate's FSDP2 for a model with qtensor weights (below)."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if plugin is not None and getattr(plugin, "fsdp_version", 1) == 2 and any(_is_layer_weight(p) for p in model.parameters()):
            raise ValueError(
                "QTensorTrainer: training under accelerate's FSDP2 (fsdp_config version 2) is not supported yet. "
                "accelerate maps the optimizer's parameters to the sharded ones by data_ptr(), and qtensor's weights "
                "(tensors without storage of their own) all give 0, so the optimizer would update the wrong tensors. "
                "Shard the model with torch.distributed.fsdp.fully_shard and train it with your own loop "
                "(docs/fsdp2.md); save_model and save_pretrained of that sharded model work on every rank."
            )
        return super().train(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`, but for a model sharded by FSDP2 with a full state dict
        (`fsdp_config` `state_dict_type` "FULL_STATE_DICT", `Trainer`'s default) every rank calls
        `save_pretrained`: its gather of the shards (`qtensor.checkpoint.state_for_writer`) is a
        collective, which `Trainer` (gathering a plain state dict that `save_pretrained` does not
        use, then calling it on rank 0 alone) would leave rank 0 waiting in. Rank 0 writes."""
        if not self._saves_sharded():
            return super().save_model(output_dir, _internal_call)
        self._save(output_dir if output_dir is not None else self.args.output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        if self._saves_sharded() and not self.args.should_save:  # not the writer: join rank 0's gather
            model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
            model.save_pretrained(output_dir if output_dir is not None else self.args.output_dir, is_main_process=False)
            return
        super()._save(output_dir, state_dict)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        state = _running_state(model) if _is_peft(model) else {}
        if state and self.args.should_save:
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, os.path.join(output_dir or self.args.output_dir, RUNNING_STATE_FILE))

    def _saves_sharded(self) -> bool:
        """Whether this run saves a model sharded by FSDP2 whole, through qtensor's gather."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        return (
            plugin is not None and "FULL_STATE_DICT" in str(plugin.state_dict_type)
            and is_qtensor_quantizer(getattr(model, "hf_quantizer", None))
            and any(hasattr(p, "_local_tensor") for p in model.parameters())
        )

    def _load_optimizer_and_scheduler(self, checkpoint_dir):
        super()._load_optimizer_and_scheduler(checkpoint_dir)
        if checkpoint_dir is not None and isinstance(self.optimizer_unwrapped(), MasterWeights):
            # Loading MasterWeights' state writes its masters back into the weights (a cast that
            # records delayed scaling's amaxes): the checkpoint's weights and histories, restored
            # again after it, are the ones the run saved.
            self._load_from_checkpoint(checkpoint_dir)

    def optimizer_unwrapped(self):
        """The optimizer `create_optimizer` made, under accelerate's wrapper if `Trainer` added one."""
        if isinstance(self.optimizer, MasterWeights):
            return self.optimizer
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        model = model if model is not None else self.model
        if _is_peft(model):  # peft's adapters, then the base's running state saved beside them
            # The base's quantizers at that step; the checkpoint holds no base weights, so a held
            # weight's format switch is checked (and refused without a master) as while training.
            hf_schedule.before_checkpoint_load(self, resume_from_checkpoint, loads_weights=False)
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            path = os.path.join(resume_from_checkpoint, RUNNING_STATE_FILE)
            if os.path.exists(path):
                from safetensors.torch import load_file

                state, live = load_file(path), _running_state(model)
                if state.keys() != live.keys():
                    raise ValueError(f"{path}: its running state is not this model's (keys differ: the base was quantized otherwise).")
                with torch.no_grad():
                    for key, tensor in state.items():
                        live[key].copy_(tensor)
            return
        if not is_qtensor_quantizer(getattr(model, "hf_quantizer", None)):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        hf_schedule.before_checkpoint_load(self, resume_from_checkpoint)  # the layers in the checkpoint's formats
        checkpoint.load_model_files(model, checkpoint_files(resume_from_checkpoint), strict=True, device=next(model.parameters()).device)


def _is_peft(model) -> bool:
    """A peft model (its `peft_config`): checkpointed as adapters over the base it was built on."""
    return isinstance(getattr(model, "peft_config", None), dict)


def _running_state(model) -> dict[str, torch.Tensor]:
    """Every quantized layer's live running-state tensors, by state_dict key."""
    return {prefix + suffix: tensor for prefix, module in hf_files.quantized_modules(model) for suffix, tensor in running_state(module).items()}


def _is_layer_weight(parameter) -> bool:
    return getattr(getattr(parameter, "_local_tensor", parameter), "is_layer_weight", False)
