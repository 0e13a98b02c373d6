"""The linear layers of a model as quantize_ and its report see them: `LinearSite`, one weight matrix
(or one stack of expert matrices) that a module multiplies its input by."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn

from .layers import experts


@dataclass(frozen=True)
class LinearSite:
    """A weight matrix that a module multiplies its input by: one linear layer of the model."""

    module: nn.Module
    module_name: str
    attribute: str  # "weight"; nn.MultiheadAttention: "in_proj_weight" or "q_proj_weight", ...
    in_features: int
    out_features: int
    transposed: bool = False  # Hugging Face Conv1D keeps its weight as [in_features, out_features]
    experts: int = 0  # a stack of this many expert matrices (layers/experts.py); 0: one matrix

    @property
    def layer(self) -> str:
        """The name the factory, filter report and messages use: the module's, or for an attention
        projection `<module>.in_proj` (`.q_proj`, ...)."""
        if self.attribute == "weight":
            return self.module_name
        return join(self.module_name, self.attribute.removesuffix("_weight"))

    @property
    def parameter(self) -> str:
        return join(self.module_name, self.attribute)


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _hf_conv1d() -> type | None:
    """transformers' Conv1D class when transformers is loaded (a model using it has loaded it)."""
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def linear_sites(module: nn.Module, name: str) -> list[LinearSite]:
    """The linear layers `module` itself holds: nn.Linear, Hugging Face Conv1D, and the input
    projections of nn.MultiheadAttention (its out_proj is an nn.Linear of its own)."""
    if isinstance(module, nn.Linear):
        return [LinearSite(module, name, "weight", module.in_features, module.out_features)]
    conv1d = _hf_conv1d()
    if conv1d is not None and isinstance(module, conv1d) and module.weight.dim() == 2:
        return [LinearSite(module, name, "weight", module.weight.shape[0], module.weight.shape[1], transposed=True)]
    if isinstance(module, nn.MultiheadAttention):
        attributes = ["in_proj_weight"] if module.in_proj_weight is not None else ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
        return [
            LinearSite(module, name, attribute, getattr(module, attribute).shape[1], getattr(module, attribute).shape[0])
            for attribute in attributes
        ]
    # A mixture of experts' fused stacks (any 3-D parameter): E matrices each.
    return [LinearSite(module, name, a, i, o, transposed=t, experts=e) for a, e, i, o, t in experts.stacks_of(module)]


EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
