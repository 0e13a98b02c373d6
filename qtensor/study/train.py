"""One training run of the convergence study: a recipe, the model, the corpus, a CSV of losses.

Every run starts from the same initial weights (built on the CPU from the seed, then moved), sees
the same batches in the same order (offsets drawn from a generator seeded alike) and follows the
same schedule: AdamW, linear warm-up, cosine decay to a floor, gradient clipping. The only
difference between runs is what `qtensor.quantize_` does to the decoder's linear layers; the output
head stays in high precision in every run (`exclude=["head"]`), and the rest of the model runs
under bf16 autocast as in the bf16 baseline.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .. import recipes
from ..quantize import quantize_
from ..recipes import Recipe
from ..schedule import Phase, PrecisionSchedule, forward_in
from .corpus import Batches, Corpus, validation_starts, windows
from .model import Decoder, ModelConfig, parameter_count

COLUMNS = ["step", "tokens", "lr", "train_loss", "grad_norm", "val_loss", "seconds"]


@dataclass
class StudyRun:
    name: str  # also the file name of its CSV
    recipe: Recipe | None  # None: the bf16 baseline
    seed_offset: int = 0  # added to the study's seed: other initial weights and batches
    high_precision_last: int = 0  # the last blocks kept in high precision (as the output head)
    about: str = ""
    # A precision schedule: from `late_from` of the steps on, the model runs with `late` (qtensor.PrecisionSchedule).
    late: Recipe | None = None
    late_from: float = 0.85


def _hybrid(**options):
    return recipes.mxfp8_fwd_nvfp4_bwd(**options)


def study_runs() -> dict[str, StudyRun]:
    """Every run the study knows, by name, in the order the tables list them."""
    runs = [
        StudyRun("bf16", None, about="the baseline: bf16 autocast, fp32 parameters"),
        StudyRun("bf16-seed1", None, seed_offset=1, about="bf16 from another seed: other initial weights and batches"),
        StudyRun("bf16-seed2", None, seed_offset=2, about="bf16 from a third seed"),
        StudyRun("bf16-seed3", None, seed_offset=3, about="bf16 from a fourth seed"),
        StudyRun("bf16-rerun", None, about="bf16 again from the same seed: the GPU's own run-to-run differences"),
        StudyRun("float8_current", Recipe(recipes.float8_current())),
        StudyRun("float8_delayed", Recipe(recipes.float8_delayed())),
        StudyRun("mxfp8", Recipe(recipes.mxfp8())),
        StudyRun("nvfp4", Recipe(recipes.nvfp4())),
        StudyRun("mxfp8_fwd_nvfp4_bwd", Recipe(_hybrid())),
        StudyRun("mxfp8_fwd_nvfp4_bwd-high_precision_bwd", Recipe(_hybrid(), backward_override="high_precision")),
        StudyRun("mxfp8_fwd_nvfp4_bwd-dequantized_bwd", Recipe(_hybrid(), backward_override="dequantized")),
        StudyRun("float8_rowwise", Recipe(recipes.float8_rowwise())),
        StudyRun("float8_rowwise_gw_hp", Recipe(recipes.float8_rowwise_gw_hp())),
        StudyRun("float8_blockwise", Recipe(recipes.float8_blockwise())),
        # Variants that test a cause of a gap (docs/convergence.md, "What was tried against the gaps").
        StudyRun("float8_current-e4m3_grad", Recipe(recipes.float8_current(grad_fp8_dtype=torch.float8_e4m3fn))),
        StudyRun("nvfp4-bf16_last2", Recipe(recipes.nvfp4()), high_precision_last=2),
        StudyRun("mxfp8_fwd_nvfp4_bwd-bf16_last2", Recipe(_hybrid()), high_precision_last=2),
        # Precision schedules: NVFP4, then for the last 15% of the steps the forward GEMMs in MXFP8, or
        # in high precision, the backward unchanged (docs/recipes.md, "Precision schedules").
        StudyRun("nvfp4-mxfp8_fwd_last15", Recipe(recipes.nvfp4()), late=Recipe(forward_in(recipes.mxfp8(), recipes.nvfp4()))),
        StudyRun("nvfp4-hp_fwd_last15", Recipe(recipes.nvfp4()), late=Recipe(forward_in(None, recipes.nvfp4()))),
    ]
    return {run.name: run for run in runs}


MAIN_RUNS = [name for name in study_runs() if name in ("bf16", "bf16-seed1") or not name.startswith("bf16")][:9]


@dataclass
class Schedule:
    steps: int
    peak: float
    warmup: int
    floor: float  # the last step's rate, as a fraction of the peak

    def lr(self, step: int) -> float:
        """Linear warm-up over `warmup` steps to `peak`, then cosine decay to `floor * peak` at `steps`."""
        if step <= self.warmup:
            return self.peak * step / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.peak * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class TrainOptions:
    steps: int = 2000
    batch: int = 16
    lr: float = 1e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    val_every: int = 100
    val_windows: int = 64
    final_val_windows: int = 512
    seed: int = 0


def build_model(config: ModelConfig, seed: int, device: torch.device) -> Decoder:
    """The initial weights depend on the seed alone: drawn on the CPU, then moved."""
    torch.manual_seed(seed)
    return Decoder(config).to(device)


def prepare(run: StudyRun, config: ModelConfig, options: TrainOptions, device: torch.device):
    """The model (quantized as the run says) and its optimizer."""
    seed = options.seed + run.seed_offset
    model = build_model(config, seed, device)
    report = schedule = None
    if run.recipe is not None:
        kept = [f"blocks.{index}" for index in range(config.blocks - run.high_precision_last, config.blocks)]
        if run.late is None:
            report = quantize_(model, run.recipe, exclude=["head", *kept])
        else:
            phases = [Phase(0, run.recipe), Phase(run.late_from, run.late)]
            schedule = PrecisionSchedule(model, phases, total_steps=options.steps, exclude=["head", *kept])
            report = schedule.report
    torch.manual_seed(seed)  # stochastic rounding draws from torch's generator: the same in every run
    # Weight decay on the matrices of the linear layers; none on norms and embedding tables.
    decays = {name: p.dim() == 2 and not name.startswith(("embed.", "position.")) for name, p in model.named_parameters()}
    groups = [
        {"params": [p for n, p in model.named_parameters() if decays[n]], "weight_decay": options.weight_decay},
        {"params": [p for n, p in model.named_parameters() if not decays[n]], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=options.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    if schedule is not None:
        schedule.attach(optimizer)  # switches after the optimizer step that ends the first phase
    return model, optimizer, report


def loss_of(model: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_step(model: Decoder, optimizer, tokens: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns the loss and the gradient norm before clipping (not synced)."""
    loss = loss_of(model, tokens)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


@torch.no_grad()
def evaluate(model: Decoder, data: torch.Tensor, count: int, length: int, batch: int, device: torch.device) -> float:
    """Mean next-byte cross-entropy (nats) over `count` fixed windows of the validation data."""
    was_training = model.training
    model.eval()
    starts = validation_starts(data, count, length)
    total = 0.0
    for chunk in starts.split(batch):
        total += loss_of(model, windows(data, chunk, length).to(device)).item() * len(chunk)
    model.train(was_training)
    return total / count


def train(run: StudyRun, corpus: Corpus, config: ModelConfig, options: TrainOptions, device: torch.device, out: str, progress=print) -> dict:
    """Train one run, writing `{out}/{run.name}.csv` (a row per step; `val_loss` every `val_every`
    steps) and `{out}/{run.name}.json` (the final validation loss, peak memory, the setup)."""
    model, optimizer, report = prepare(run, config, options, device)
    lr_schedule = Schedule(options.steps, options.lr, options.warmup, options.min_lr_ratio)
    batches = Batches(corpus.train, options.batch, config.length, options.seed + run.seed_offset)
    tokens_per_step = options.batch * config.length
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    path = os.path.join(out, f"{run.name}.csv")
    seconds, started = 0.0, time.time()
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(COLUMNS)
        for step in range(1, options.steps + 1):
            tokens = batches.next().to(device, non_blocking=True)
            start = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_schedule.lr(step)
            loss, grad_norm = train_step(model, optimizer, tokens, options.clip)
            loss, grad_norm = loss.item(), grad_norm.item()  # waits for the step
            seconds += time.perf_counter() - start
            val = ""
            if step % options.val_every == 0 or step == options.steps:
                val = f"{evaluate(model, corpus.validation, options.val_windows, config.length, options.batch, device):.6f}"
            writer.writerow([step, step * tokens_per_step, f"{lr_schedule.lr(step):.6g}", f"{loss:.6f}", f"{grad_norm:.4f}", val, f"{seconds:.3f}"])
            if val:
                file.flush()
                progress(f"{run.name:<42} step {step:>5}/{options.steps}  loss {loss:.4f}  val {float(val):.4f}  {seconds:7.1f} s")
            if not math.isfinite(loss):
                progress(f"{run.name}: the loss is {loss} at step {step}; stopping this run.")
                break
    final = evaluate(model, corpus.validation, options.final_val_windows, config.length, options.batch, device)
    summary = {
        "name": run.name,
        "recipe": repr(run.recipe) if run.recipe is not None else "bf16",
        "late": {"recipe": repr(run.late), "from_step": math.floor(run.late_from * options.steps)} if run.late is not None else None,
        "seed": options.seed + run.seed_offset,
        "final_val_loss": final,
        "final_val_windows": options.final_val_windows,
        "steps": step,
        "tokens": step * tokens_per_step,
        "train_seconds": seconds,
        "wall_seconds": time.time() - started,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "parameters": parameter_count(model),
        "quantized_layers": len(report.quantized) if report is not None else 0,
        "model": asdict(config),
        "options": asdict(options),
        "corpus": {"root": corpus.root, "sha256": corpus.sha256, "train_bytes": corpus.train.numel(), "validation_bytes": corpus.validation.numel()},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    with open(os.path.join(out, f"{run.name}.json"), "w") as file:
        json.dump(summary, file, indent=1)
    progress(f"{run.name:<42} final validation loss {final:.4f} ({options.final_val_windows} windows)")
    return {"model": model, "summary": summary}


def measure_speed(run: StudyRun, corpus: Corpus, config: ModelConfig, options: TrainOptions, device: torch.device, steps: int) -> dict:
    """Tokens/s and peak memory of `steps` training steps after 3 unmeasured ones (on a GPU the run
    has to itself: the study's training may share one)."""
    model, optimizer, _ = prepare(run, config, options, device)
    batches = Batches(corpus.train, options.batch, config.length, options.seed)

    def step():
        train_step(model, optimizer, batches.next().to(device), options.clip)

    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else ""
    return {"name": run.name, "tokens_per_s": steps * options.batch * config.length / elapsed, "step_ms": 1000 * elapsed / steps, "peak_gib": peak}
