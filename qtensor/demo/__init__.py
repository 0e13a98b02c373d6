"""qtensor's main job: train one stock transformer language model under several recipes.

    python -m qtensor.demo [--steps N] [--spread-seeds S] [--d-model D] [--layers L] [--device cpu|cuda]
    torchrun --nproc-per-node N -m qtensor.demo --fsdp     (FSDP2: gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node N -m qtensor.demo --tp T     (tensor parallelism over T ranks, FSDP2 over N / T)

The model is built in code (nn.TransformerEncoder layers with a causal mask, an embedding and an
output head) and learns to write sums ("37+45=82;") from a synthetic stream, so nothing is
downloaded. Every recipe starts from the same weights and sees the same batches; the only difference
is what qtensor.quantize_ does to the model's linear layers (nn.Linear and the attention
in-projections; the head stays in bf16). All runs,
the baseline too, use bf16 autocast for the rest of the model.

The numbers are deterministic: the demo runs on one CPU thread with torch's deterministic
algorithms, so a rerun, or a run under another OMP_NUM_THREADS, prints the same losses. bf16 is also
trained from --spread-seeds other seeds (other initial weights, other batches): the spread of those
final losses is bf16's own run-to-run noise, and the table says which recipes' gaps exceed it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from torch import nn

from .. import recipes
from ..checkpoint import load_model, save_model
from .formats_table import print_formats_table
from ..distributed.fsdp import gather_stats
from ..layers.dynamic_weight import DynamicWeight
from ..optim import MasterWeights
from ..quantize import linear_sites, quantize_
from ..recipes import Recipe
from ..core.tensor import QuantizedTensor

VOCABULARY = "0123456789+=;"


def sums_stream(batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`batch` token rows of `length + 1` characters cut from a stream of "a+b=c;" with a, b < 100."""
    rows = []
    for _ in range(batch):
        text = ""
        while len(text) < length + 1 + 10:
            a, b = torch.randint(0, 100, (2,), generator=generator).tolist()
            text += f"{a}+{b}={a + b};"
        start = int(torch.randint(0, 10, (1,), generator=generator))
        rows.append([VOCABULARY.index(c) for c in text[start : start + length + 1]])
    return torch.tensor(rows)


class TinyLM(nn.Module):
    """A causal transformer LM from stock modules only."""

    def __init__(self, vocabulary: int, d_model: int, layers: int, heads: int, length: int):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, d_model)
        self.position = nn.Parameter(torch.randn(length, d_model) * 0.02)
        block = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocabulary)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        hidden = self.blocks(hidden, mask=self.causal[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(hidden))


@dataclass
class Run:
    name: str
    recipe: Recipe | None
    weights: str = "dynamic"
    family: str = ""  # what --only matches besides the name (the base recipe of an override run)
    seed_offset: int = 0  # added to --seed: the initial weights and the batches this run sees


def spread_runs(count: int) -> list[Run]:
    """bf16 again from `count` other seeds: its run-to-run spread, against which the gaps are read."""
    return [Run(f"bf16, seed +{offset}", None, seed_offset=offset) for offset in range(1, count + 1)]


def build_model(args, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TinyLM(len(VOCABULARY), args.d_model, args.layers, args.heads, args.length)


@contextlib.contextmanager
def deterministic_settings(device: torch.device):
    """One CPU thread and torch's deterministic algorithms while the demo trains; restored after.

    A CPU GEMM splits its reductions by thread count, so two threads and one round differently
    (README, "What the demo shows"); one thread gives the same losses whatever OMP_NUM_THREADS says.
    """
    threads, enabled, warn_only = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if device.type == "cuda":
        # cuBLAS is deterministic only with a fixed workspace, read when its first handle is made.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def demo_runs() -> list[Run]:
    def keep_head(factory):
        # Roles carry the layer's name: keep the output head in high precision.
        return lambda role: None if role.name == "head" else factory(role)

    hybrid = keep_head(recipes.mxfp8_fwd_nvfp4_bwd())
    return [
        Run("bf16", None),
        Run("float8_current", Recipe(keep_head(recipes.float8_current()))),
        Run("float8_delayed", Recipe(keep_head(recipes.float8_delayed()))),
        Run("float8_rowwise", Recipe(keep_head(recipes.float8_rowwise()))),
        Run("float8_blockwise", Recipe(keep_head(recipes.float8_blockwise()))),
        Run("mxfp8", Recipe(keep_head(recipes.mxfp8()))),
        Run("mxfp8, quantized weights", Recipe(keep_head(recipes.mxfp8())), weights="quantized"),
        Run("nvfp4", Recipe(keep_head(recipes.nvfp4()))),
        Run("mxfp8_fwd_nvfp4_bwd", Recipe(hybrid)),
        Run("  + high_precision bwd", Recipe(hybrid, backward_override="high_precision"), family="mxfp8_fwd_nvfp4_bwd"),
        Run("  + dequantized bwd", Recipe(hybrid, backward_override="dequantized"), family="mxfp8_fwd_nvfp4_bwd"),
    ]


def linear_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """Bytes of the linear layers' weights (nn.Linear and the attention in-projections) as the GEMMs
    read them: (forward copy, forward + backward copies).

    A bf16 weight serves both directions (2 bytes per element); a quantized one keeps a rowwise
    copy for fprop and a columnwise copy for dgrad, each with its scales.
    """
    forward = total = 0
    for name, module in model.named_modules():
        for site in linear_sites(module, name):
            weight = getattr(module, site.attribute)
            weight = getattr(weight, "_local_tensor", weight)  # a sharded model: this rank's shard
            if isinstance(weight, DynamicWeight) and weight.linear_quantizers.weight is not None:
                plain = weight.plain().detach()
                plain = plain.t() if weight.linear_quantizers.transposed else plain
                weight = weight.linear_quantizers.weight.quantize(plain)
            if isinstance(weight, QuantizedTensor):
                total += weight.storage_nbytes()
                forward += _rowwise_nbytes(weight)
            else:
                forward += weight.numel() * 2  # bf16 under autocast
                total += weight.numel() * 2
    return forward, total


def _rowwise_nbytes(weight: QuantizedTensor) -> int:
    rowwise = weight.detach()
    rowwise.update_usage(columnwise=False)
    return rowwise.storage_nbytes()


class ProgressBar:
    def __init__(self, total: int, label: str, width: int = 30, quiet: bool = False):
        self.total, self.label, self.width, self.quiet = total, label, width, quiet
        self.interactive = sys.stderr.isatty()

    def update(self, step: int, loss: float) -> None:
        if self.quiet or (not self.interactive and step not in (1, self.total)):
            return
        filled = self.width * step // self.total
        end = "\n" if step == self.total or not self.interactive else ""
        print(
            f"\r{self.label:<26} [{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total} loss {loss:.3f}",
            end=end,
            file=sys.stderr,
            flush=True,
        )


def train_step(model: nn.Module, optimizer, tokens: torch.Tensor, autocast: bool = True) -> torch.Tensor:
    """One optimizer step of next-token prediction on `tokens` [batch, length + 1], the rest of the
    model under bf16 autocast (as every run of the main job); returns the loss."""
    context = torch.autocast(tokens.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


class Sharding:
    """--fsdp / --tp: one process of a torchrun launch. Every rank trains on the same batches, so the
    table is the single-process one (up to the rounding of tensor-parallel partial sums); FSDP2
    (fully_shard on each block, then the root) shards the weights and all-gathers them in low
    precision. With --tp T the ranks form a ("dp", "tp") mesh: each block's MLP is tensor-parallel
    over "tp" with torch's own styles (linear1 ColwiseParallel, linear2 RowwiseParallel; the packed
    attention in-projection stays whole), and FSDP2 shards over "dp"."""

    def __init__(self, device_type: str, tp: int = 1):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        self.rank, self.world_size, self.tp = dist.get_rank(), dist.get_world_size(), tp
        if self.world_size % tp:
            raise SystemExit(f"--tp {tp} must divide the {self.world_size} ranks of the launch (torchrun --nproc-per-node).")
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        if tp > 1:
            mesh = init_device_mesh(device_type, (self.world_size // tp, tp), mesh_dim_names=("dp", "tp"))
            self.mesh, self.tp_mesh = mesh["dp"], mesh["tp"]
        else:
            self.mesh = init_device_mesh(device_type, (self.world_size,))
        self.tp_bytes = 0  # bytes this rank handed to tensor-parallel all-reduces since the last reset

    def describe(self) -> str:
        if self.tp == 1:
            return f"{self.world_size} ranks (FSDP2)"
        return f"{self.world_size} ranks ({self.world_size // self.tp}-way FSDP2 x {self.tp}-way tensor parallel)"

    def shard(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.tp > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            for layer in model.blocks.layers:
                parallelize_module(layer, self.tp_mesh, {"linear1": ColwiseParallel(), "linear2": RowwiseParallel()})
                self._count_all_reduces(layer)
        for layer in model.blocks.layers:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)

    def _count_all_reduces(self, layer: nn.Module) -> None:
        """Count what the MLP's two all-reduces carry: linear2's partial sums in the forward, and
        the partial gradient of linear1's input in the backward."""

        def counted(tensor):
            local = getattr(tensor, "_local_tensor", tensor)
            self.tp_bytes += local.numel() * local.element_size()

        layer.linear2.register_forward_hook(lambda module, args, output: counted(output))

        def watch_input(module, args):
            if args[0].requires_grad:
                args[0].register_hook(counted)

        layer.linear1.register_forward_pre_hook(watch_input)

    def close(self) -> None:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def train(run: Run, base: nn.Module, args, device: torch.device, sharding: Sharding | None = None) -> dict:
    seed = args.seed + run.seed_offset
    # Each run draws its stochastic-rounding keys from a freshly seeded generator, so its numbers do
    # not depend on which runs came before it (--only).
    torch.manual_seed(seed)
    model = copy.deepcopy(base).to(device)
    if run.recipe is not None:
        quantize_(model, run.recipe, weights=run.weights)
    if sharding is not None:
        sharding.shard(model)
        gather_stats(reset=True)
        sharding.tp_bytes = 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if run.weights == "quantized":
        optimizer = MasterWeights(optimizer)
    generator = torch.Generator().manual_seed(seed)
    bar = ProgressBar(args.steps, run.name, quiet=sharding is not None and sharding.rank != 0)
    losses, times = [], []
    for step in range(1, args.steps + 1):
        tokens = sums_stream(args.batch, args.length, generator).to(device)
        start = time.perf_counter()
        loss = train_step(model, optimizer, tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        bar.update(step, losses[-1])
    tail = max(1, args.steps // 10)
    gathered = gather_stats(reset=True)
    return {
        "final_loss": sum(losses[-tail:]) / tail,
        "weight_bytes": linear_weight_bytes(model),
        "step_ms": 1000 * sorted(times[1:] or times)[len(times[1:] or times) // 2],
        # Under --fsdp the table reports the all-gather bytes instead of a save and reload.
        "checkpoint": save_and_reload(run, model, base, args, device) if run.recipe is not None and sharding is None else None,
        "gathered": (gathered["bytes"] / args.steps, gathered["bf16_bytes"] / args.steps) if sharding else None,
        "tp_bytes": sharding.tp_bytes / args.steps if sharding else None,
    }


def save_and_reload(run: Run, model: nn.Module, base: nn.Module, args, device: torch.device) -> tuple[int, bool]:
    """Save the trained model with qtensor.save_model, load it into a fresh model quantized with the
    same recipe, and compare logits: (bytes on disk, whether the reloaded logits are identical)."""
    path = os.path.join(args.save_dir, run.name.strip(" +").replace(" ", "_").replace(",", "") + ".safetensors")
    save_model(model, path)
    fresh = copy.deepcopy(base).to(device)
    quantize_(fresh, run.recipe, weights=run.weights)
    load_model(fresh, path)
    tokens = sums_stream(args.batch, args.length, torch.Generator().manual_seed(args.seed + 1)).to(device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        identical = torch.equal(fresh(tokens[:, :-1]), model(tokens[:, :-1]))
    return os.path.getsize(path), identical


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qtensor.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per recipe (default 120)")
    parser.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--spread-seeds",
        type=int,
        default=4,
        help="train bf16 from this many other seeds to show its run-to-run spread (default 4)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", nargs="*", help="run only the recipes whose names contain one of these (and bf16)")
    parser.add_argument("--formats", action="store_true", help="print the per-format error table and exit")
    parser.add_argument("--save-dir", help="where each run's model is saved (default: a temporary directory)")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (launch with torchrun --nproc-per-node N)")
    parser.add_argument(
        "--tp", type=int, default=1,
        help="tensor parallelism over this many ranks, FSDP2 over the rest (launch with torchrun; implies --fsdp)",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sharding = Sharding(device.type, args.tp) if args.fsdp or args.tp > 1 else None
    if sharding is not None:
        device = sharding.device
    if args.formats:
        print_formats_table(device=args.device)
        return

    runs = [
        r for r in demo_runs() if not args.only or r.name == "bf16" or any(o in r.name + r.family for o in args.only)
    ]
    runs += spread_runs(args.spread_seeds)
    lead = sharding is None or sharding.rank == 0
    if lead:
        where = sharding.describe() if sharding else str(device)
        print(
            f"TinyLM d_model={args.d_model} layers={args.layers} on {where}: {args.steps} steps of "
            f"{args.batch}x{args.length} tokens per recipe (uniform guess: loss {math.log(len(VOCABULARY)):.3f})",
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory() as scratch, deterministic_settings(device):
        args.save_dir = args.save_dir or scratch
        os.makedirs(args.save_dir, exist_ok=True)
        bases = {offset: build_model(args, args.seed + offset) for offset in {run.seed_offset for run in runs}}
        results = {run.name: train(run, bases[run.seed_offset], args, device, sharding) for run in runs}
    if lead:
        print_table(results, args, sharding)
    if sharding is not None:
        sharding.close()
        # docs/design.md, FSDP2: a gloo process group can abort at interpreter exit; leave without the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def bf16_spread(results: dict) -> float | None:
    """max - min of bf16's final losses over its seeds; None when it ran from one seed only."""
    losses = [result["final_loss"] for name, result in results.items() if name.startswith("bf16")]
    return max(losses) - min(losses) if len(losses) > 1 else None


def print_table(results: dict, args, sharding: Sharding | None) -> None:
    baseline = results["bf16"]["final_loss"]
    spread = bf16_spread(results)
    last = f"{'all-gather KiB/step (bf16)':>28}" if sharding else f"{'file KiB':>10}  reload"
    if sharding and sharding.tp > 1:
        last += f"{'TP all-reduce KiB/step':>24}"
    print(
        f"\n{'recipe':<26}{'final loss':>11}{'gap to bf16':>13}{'vs bf16 spread':>16}"
        f"{'weight KiB fwd/all':>20}{'step ms':>10}{last}"
    )
    # bf16 and its other seeds first: their gaps are the noise the recipes' gaps are read against.
    ordered = sorted(results.items(), key=lambda item: not item[0].startswith("bf16"))
    for name, result in ordered:
        gap = result["final_loss"] - baseline
        if name == "bf16":
            verdict = f"{spread:.4f}" if spread is not None else "-"
        elif name.startswith("bf16") or spread is None:
            verdict = "-"
        else:
            verdict = "within" if abs(gap) <= spread else ("worse" if gap > 0 else "better")
        forward, total = result["weight_bytes"]
        if sharding:
            sent, bf16 = result["gathered"]
            tail = f"{sent / 1024:>19.1f} ({bf16 / 1024:.1f})" if sent else f"{'-':>19}"
            if sharding.tp > 1:
                tail = f"{tail:<28}{result['tp_bytes'] / 1024:>24.1f}"
        else:
            saved = result["checkpoint"]
            tail = f"{saved[0] / 1024:>10.1f}  {'identical' if saved[1] else 'DIFFERENT'}" if saved else f"{'':>10}  -"
        print(
            f"{name:<26}{result['final_loss']:>11.4f}{gap:>+13.4f}{verdict:>16}"
            f"{forward / 1024:>11.1f} /{total / 1024:>7.1f}{result['step_ms']:>10.1f}{tail}"
        )
    print(
        f"final loss: mean of the last {max(1, args.steps // 10)} steps. weight KiB: the nn.Linear weights "
        "as the GEMMs read them, forward copy / forward and backward copies (bf16 serves both)"
        + (", of this rank's shards." if sharding else ".")
    )
    if spread is not None:
        exceeding = [
            name for name, result in results.items()
            if not name.startswith("bf16") and abs(result["final_loss"] - baseline) > spread
        ]
        print(
            f"vs bf16 spread: bf16 trained from {args.spread_seeds + 1} seeds (other initial weights and "
            f"batches) ends {spread:.4f} apart from highest to lowest final loss; a recipe's gap within that "
            "is noise, not a difference (worse / better: the gap exceeds it). "
            + (f"Gaps beyond the spread: {', '.join(n.strip(' +') for n in exceeding)}." if exceeding else "No gap exceeds it.")
        )
    else:
        print("vs bf16 spread: bf16 ran from one seed only (--spread-seeds 0), so the gaps have no yardstick.")
    if sharding:
        print(
            "all-gather KiB/step: what one rank handed to FSDP2's all-gathers of the quantized weights per "
            "step (forward gather and backward re-gather), and in parentheses what bf16 weights would have "
            "sent. Every rank trains on the same batches, so the losses are the single-process ones (on GPUs up "
            "to AdamW's foreach rounding, README \"Known limits\"). No checkpoint is written in this mode."
        )
        if sharding.tp > 1:
            print(
                "TP all-reduce KiB/step: what one rank handed to the tensor-parallel MLPs' all-reduces per step, "
                "in the activations' dtype (bf16 under autocast): linear2's partial sums in the forward, the "
                "partial gradient of linear1's input in the backward. Partial sums stay in high precision. "
                "The rounding of those sums differs from one process's, so the losses may differ from a "
                "single-process run in the last digits."
            )
    else:
        reloaded = [r["checkpoint"][1] for r in results.values() if r["checkpoint"]]
        print(
            "file KiB / reload: each quantized run's final model saved with qtensor.save_model, loaded with "
            "qtensor.load_model into a fresh model quantized with the same recipe; its logits were identical "
            f"in {sum(reloaded)} of {len(reloaded)} runs."
        )


if __name__ == "__main__":
    main()
