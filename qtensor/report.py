"""QuantizeReport: what quantize_ did to a model, layer by layer, and how much of the model stays in
high precision: its parameters, and the multiply-accumulates its weight matrices do per token."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from .layers import experts
from .sites import EMBEDDINGS, join, linear_sites

# Where a mixture of experts says how many experts each token goes to: on the experts module, on the
# block holding it, or on the router beside it (`top_k`); in a Hugging Face model's config.
_PER_TOKEN_ON_MODULES = ("num_experts_per_tok", "experts_per_token", "top_k")
_PER_TOKEN_ON_CONFIG = ("num_experts_per_tok", "experts_per_token")


@dataclass(frozen=True)
class Counts:
    """A count split by precision. `low`: in quantized layers; `high`: in high precision. `unknown`:
    the layers whose count cannot be known, left out of both. `embedding_tables`: the part of `high`
    held by embedding tables (parameters only: a lookup multiplies nothing)."""

    low: int
    high: int
    unknown: tuple[str, ...] = ()
    embedding_tables: int = 0

    @property
    def total(self) -> int:
        return self.low + self.high

    @property
    def low_fraction(self) -> float | None:
        """low / total; None when nothing was counted."""
        return self.low / self.total if self.total else None


@dataclass
class QuantizeReport:
    """What quantize_ did: `quantized` (layer → description) and `skipped` (layer → why it stays in
    high precision). Every module holding a weight matrix appears in one of the two. A model that is
    itself one linear layer (a bare nn.Linear) names that layer `''`.

    The counts describe the model as the call left it (layers an earlier call quantized included):
    - `parameters`: every parameter, a shared one once, by its logical size; a quantized layer's
      weight is low precision, everything else (biases, norms, embedding tables, skipped layers) high.
    - `macs_per_token`: the multiply-accumulates of the weight matrices for one token: in × out for a
      linear layer (the output head included), experts-per-token × in × out for a stack of experts
      where the model says how many experts a token goes to (`num_experts_per_tok`, `top_k`), unknown
      where it does not and for a weight matrix of a layer type qtensor does not know. Embedding
      lookups are no multiply-accumulates; attention's score and value products (no weights) are not
      counted. Each module counts once, as if it ran once per token.
    - `macs_by_layer`: layer → (its multiply-accumulates per token or None, in low precision).
    None where the report was not given a model to count (`count`)."""

    quantized: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    # The model's last linear layer (in registration order): its output head for a language model or
    # classifier. quantize_ treats it like any other layer; `exclude=[name]` keeps it in high precision.
    output_head: str | None = None
    parameters: Counts | None = None
    macs_per_token: Counts | None = None
    macs_by_layer: dict[str, tuple[int | None, bool]] = field(default_factory=dict)

    def count(self, model: nn.Module) -> QuantizeReport:
        """Count `model`'s parameters and multiply-accumulates per token as it stands now (quantize_
        does at its end). Returns the report."""
        low_ids, layers, embedding_ids = set(), {}, set()
        for name, module in model.named_modules():
            quantized = module.__dict__.get("_qtensor_layers", {})  # what quantize_ installed (quantize.py)
            seen = set()
            for site in linear_sites(module, name):
                seen.add(site.attribute)
                if site.attribute in quantized:
                    low_ids.add(id(getattr(module, site.attribute)))
                per_token = _experts_per_token(model, name, module) if site.experts else 1
                macs = None if per_token is None else per_token * site.in_features * site.out_features
                layers[site.layer] = (macs, site.attribute in quantized)
            for attribute, param in module.named_parameters(recurse=False):
                if isinstance(module, EMBEDDINGS):
                    embedding_ids.add(id(param))
                if attribute in seen or param.dim() < 2 or isinstance(module, EMBEDDINGS):
                    continue  # an embedding table is looked up
                if attribute == "weight" and param.dim() == 2 and experts.is_router(module):
                    layers[name] = (param.shape[0] * param.shape[1], False)  # scores every expert, in high precision
                elif attribute == "weight" and param.dim() == 2:
                    layers[name] = (None, False)  # a layer type qtensor does not know
                elif param.dim() > 2:
                    layers[join(name, attribute)] = (None, False)  # not a stack qtensor reads
                # Another 2-D parameter (a learned position table, a stack's biases) is not a layer's
                # weight (quantize_'s report says so): added, not multiplied.
        sizes = {id(p): p.numel() for p in model.parameters()}  # a shared parameter once; logical sizes
        low = sum(sizes[i] for i in low_ids if i in sizes)
        tables = sum(sizes[i] for i in embedding_ids if i in sizes and i not in low_ids)
        self.parameters = Counts(low, sum(sizes.values()) - low, embedding_tables=tables)
        unknown = tuple(name for name, (macs, _) in layers.items() if macs is None)
        low_macs = sum(macs for macs, is_low in layers.values() if macs is not None and is_low)
        high_macs = sum(macs for macs, is_low in layers.values() if macs is not None and not is_low)
        self.macs_per_token = Counts(low_macs, high_macs, unknown)
        self.macs_by_layer = layers
        return self

    def merge(self, later: QuantizeReport) -> None:
        """Take in the report of a later quantize_ call on the same model that quantized layers this one
        left (from_pretrained quantizes expert stacks in a second call): its quantized layers move to
        `quantized`, a layer this call filtered out takes the later call's reason, and the counts
        become the later call's, which counted the model as both calls left it."""
        for name, text in later.quantized.items():
            self.skipped.pop(name, None)
            self.quantized[name] = text
        for name, text in later.skipped.items():
            if self.skipped.get(name) == "filtered out by filter_fn" and text != self.skipped[name]:
                self.skipped[name] = text  # a layer the first call left to the later one
        if later.parameters is not None:
            self.parameters, self.macs_per_token, self.macs_by_layer = later.parameters, later.macs_per_token, later.macs_by_layer

    def mostly_high_precision(self) -> str | None:
        """A warning, when more than half of the multiply-accumulates per token that can be known, or
        of the parameters outside embedding tables (lookups no recipe quantizes), stay in high
        precision; else None. It names the layers that hold most of the high-precision compute."""
        macs, params = self.macs_per_token, self.parameters
        if macs is None or params is None:
            return None
        matrices = params.total - params.embedding_tables
        macs_high = macs.total > 0 and macs.high * 2 > macs.total
        params_high = matrices > 0 and (params.high - params.embedding_tables) * 2 > matrices
        if not (macs_high or params_high):
            return None
        parts = []
        if macs.total:
            parts.append(f"{_percent(macs.high, macs.total)} of its multiply-accumulates per token")
        if matrices:
            parts.append(f"{_percent(params.high - params.embedding_tables, matrices)} of its parameters outside embedding tables")
        message = (
            f"qtensor: {_layers(len(self.quantized))} quantized and {len(self.skipped)} skipped, but most of the model stays "
            f"in high precision: {' and '.join(parts)}."
        )
        largest = self._largest_high(macs.total)
        if largest:
            message += f" The most compute in high precision: {', '.join(largest)}."
        if macs.unknown:
            message += f" Not counted (unknown): {_names(macs.unknown)}."
        return message + " The report (print(report), or model.qtensor_report) says why each layer was skipped."

    def _largest_high(self, total: int, count: int = 3) -> list[str]:
        """The high-precision layers holding the most multiply-accumulates, grouped over repeated blocks
        (`model.layers.*.mlp.experts.down_proj`), with their share of the whole."""
        groups: dict[str, int] = {}
        for name, (macs, low) in self.macs_by_layer.items():
            if macs and not low:
                group = re.sub(r"(^|\.)\d+(?=\.)", r"\1*", name)
                groups[group] = groups.get(group, 0) + macs
        ranked = sorted(groups.items(), key=lambda item: -item[1])[:count]
        return [f"{_shown(name)} ({_percent(macs, total)})" for name, macs in ranked]

    def __str__(self) -> str:
        rows = [(_shown(name), "quantized", text) for name, text in self.quantized.items()]
        rows += [(_shown(name), "skipped", text) for name, text in self.skipped.items()]
        width = max([len("layer")] + [len(name) for name, _, _ in rows])
        lines = [f"{'layer':<{width}}  {'status':<9}  details"]
        lines += [f"{name:<{width}}  {status:<9}  {text}" for name, status, text in rows]
        lines.append(f"{len(self.quantized)} quantized, {len(self.skipped)} skipped")
        lines += self._count_lines()
        if self.output_head == "":
            status = "quantized" if "" in self.quantized else "in high precision"
            lines.append(f"the model is itself a single linear layer (named '' in report.quantized and report.skipped), {status}")
        elif self.output_head is not None:
            status = "quantized" if self.output_head in self.quantized else "in high precision"
            hint = f"; exclude=[{self.output_head!r}] keeps it in high precision" if status == "quantized" else ""
            lines.append(f"output head (the last linear layer): {self.output_head!r}, {status}{hint}")
        return "\n".join(lines)

    def _count_lines(self) -> list[str]:
        lines = []
        if self.parameters is not None:
            params = self.parameters
            lines.append(f"parameters: {_split(params, params.embedding_tables)}")
        if self.macs_per_token is not None:
            macs = self.macs_per_token
            unknown = f"; unknown, left out: {_names(macs.unknown)}" if macs.unknown else ""
            lines.append(f"multiply-accumulates per token: {_split(macs)}{unknown}")
        return lines


def _split(counts: Counts, tables: int = 0) -> str:
    if not counts.total:
        return "none counted"
    in_tables = f", {tables:,} of them in embedding tables" if tables else ""
    return (
        f"{_percent(counts.low, counts.total)} in low precision ({counts.low:,} of {counts.total:,}), "
        f"{_percent(counts.high, counts.total)} in high precision ({counts.high:,}{in_tables})"
    )


def _percent(part: int, whole: int) -> str:
    """part / whole as a whole percentage that reads 0% or 100% only when it is exactly so."""
    value = round(100 * part / whole)
    if 0 < part < whole:
        value = min(max(value, 1), 99)
    return f"{value}%"


def _layers(count: int) -> str:
    return f"{count} layer{'' if count == 1 else 's'}"


def _shown(name: str) -> str:
    return name or "(the model)"


def _names(names, count: int = 3) -> str:
    shown = ", ".join(_shown(name) for name in names[:count])
    return shown + (f" and {len(names) - count} more" if len(names) > count else "")


def _experts_per_token(model: nn.Module, name: str, module: nn.Module) -> int | None:
    """How many experts each token goes to, for the stacks `module` holds: an attribute of the module,
    of the block holding it, or of a module beside it (the router's `top_k`), else the model config's
    `num_experts_per_tok`; None where none says."""
    near = [module]
    if name:
        parent = model.get_submodule(name.rpartition(".")[0])
        near += [parent, *(child for child in parent.children() if child is not module)]
    for owner in near:
        for attribute in _PER_TOKEN_ON_MODULES:
            value = _positive_int(getattr(owner, attribute, None))
            if value is not None:
                return value
    config = getattr(model, "config", None)
    configs = [config, config.get_text_config()] if hasattr(config, "get_text_config") else [config]
    for owner in configs:
        for attribute in _PER_TOKEN_ON_CONFIG:
            value = _positive_int(getattr(owner, attribute, None))
            if value is not None:
                return value
    return None


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
