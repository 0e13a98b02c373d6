"""A precision schedule in the Hugging Face `Trainer` (qtensor/schedule.py).

    schedule = qtensor.PrecisionSchedule(model, phases)  # a model from_pretrained with a QTensorConfig too
    trainer = qtensor.hf.QTensorTrainer(model=model, args=args, train_dataset=data,
                                        callbacks=[qtensor.hf.PrecisionScheduleCallback(schedule)])

The Trainer's global step is the schedule's position: after each optimizer step the model is in
that step's phase, and a run resumed from a checkpoint starts in the checkpoint's step's phase
(the Trainer restores its step, the weights and the optimizer's state before training begins).
"""

from __future__ import annotations

import json
import os

from transformers import TrainerCallback

from .optim import MasterWeights
from .schedule import PrecisionSchedule


class PrecisionScheduleCallback(TrainerCallback):
    """Keeps `schedule` at the Trainer's global step (module docstring). Weights held quantized
    are cast again from the masters of the Trainer's `MasterWeights` (QTensorTrainer makes it).
    Resuming, `QTensorTrainer` moves the schedule to the checkpoint's step before it loads the
    checkpoint's weights, which are in that step's formats."""

    def __init__(self, schedule: PrecisionSchedule):
        if not isinstance(schedule, PrecisionSchedule):
            raise TypeError(f"PrecisionScheduleCallback takes a qtensor.PrecisionSchedule, got {type(schedule).__name__}.")
        self.schedule = schedule

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        # (A resumed run's schedule is at the checkpoint's step already: QTensorTrainer moved it
        # there before loading the checkpoint's weights, `before_checkpoint_load`.)
        self.schedule.optimizer = _unwrapped(optimizer)
        self.schedule.go_to_step(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.schedule.go_to_step(state.global_step)


def _unwrapped(optimizer):
    """The Trainer's optimizer inside accelerate's wrapper: a MasterWeights where there is one."""
    while optimizer is not None and not isinstance(optimizer, MasterWeights) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def before_checkpoint_load(trainer, directory, loads_weights: bool = True) -> None:
    """Before `trainer` loads the checkpoint in `directory`: each schedule of its callbacks at the
    checkpoint's global step, so that the model's layers are in the formats the checkpoint's were
    saved in (its `trainer_state.json` says the step). `loads_weights=False` (a peft checkpoint,
    which holds no base weights): held weights switch as while training, cast from their masters
    and refused without one, since no load replaces them afterwards."""
    schedules = [c.schedule for c in trainer.callback_handler.callbacks if isinstance(c, PrecisionScheduleCallback)]
    path = os.path.join(directory, "trainer_state.json")
    if not schedules or not os.path.exists(path):
        return
    with open(path) as file:
        step = json.load(file)["global_step"]
    for schedule in schedules:
        schedule.go_to_step(step, before_loading=loads_weights)
