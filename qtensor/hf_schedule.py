"""A precision schedule in the Hugging Face `Trainer` (qtensor/schedule.py).

    schedule = qtensor.PrecisionSchedule(model, phases)  # a model from_pretrained with a QTensorConfig too
    trainer = qtensor.hf.QTensorTrainer(model=model, args=args, train_dataset=data,
                                        callbacks=[qtensor.hf.PrecisionScheduleCallback(schedule)])

The Trainer's global step is the schedule's position: after each optimizer step the model is in
that step's phase, and a run resumed from a checkpoint starts in the checkpoint's step's phase
(the Trainer restores its step, the weights and the optimizer's state before training begins).
"""

from __future__ import annotations

from transformers import TrainerCallback

from .optim import MasterWeights
from .schedule import PrecisionSchedule


class PrecisionScheduleCallback(TrainerCallback):
    """Keeps `schedule` at the Trainer's global step (module docstring). Weights held quantized
    are cast again from the masters of the Trainer's `MasterWeights` (QTensorTrainer makes it).
    Resuming from a checkpoint saved after a switch loads that phase's held weights into a model
    in the first phase's formats, which fails: resume held weights from a checkpoint of the phase
    the model starts in (dynamic weights resume from any)."""

    def __init__(self, schedule: PrecisionSchedule):
        if not isinstance(schedule, PrecisionSchedule):
            raise TypeError(f"PrecisionScheduleCallback takes a qtensor.PrecisionSchedule, got {type(schedule).__name__}.")
        self.schedule = schedule

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.schedule.optimizer = _unwrapped(optimizer)
        self.schedule.go_to_step(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.schedule.go_to_step(state.global_step)


def _unwrapped(optimizer):
    """The Trainer's optimizer inside accelerate's wrapper: a MasterWeights where there is one."""
    while optimizer is not None and not isinstance(optimizer, MasterWeights) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer
