"""nn.MultiheadAttention with quantized projection weights.

nn.MultiheadAttention hands its projection weights to F.multi_head_attention_forward, whose body
calls F.linear out of reach of a weight's `__torch_function__`. `multi_head_attention` runs the
projections through the quantized linear itself and the body on the projected q, k, v with
identity projections that cost nothing.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from .config import carries_quantizers
from .linear import quantized_linear

aten = torch.ops.aten

_ATTENTION_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_PROJECTION_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj_weight")


def multi_head_attention(args, kwargs):
    """nn.MultiheadAttention hands its projection weights to F.multi_head_attention_forward, whose
    body calls F.linear out of reach of this subclass. Here the in-projections run first (quantized
    where their weights carry quantizers), the body runs on the projected q, k, v with identity
    projections that cost nothing, and the out-projection runs on its result."""
    bound = _ATTENTION_SIGNATURE.bind(*args, **kwargs)
    arguments = bound.arguments
    if not any(carries_quantizers(arguments.get(name)) for name in _PROJECTION_WEIGHTS):
        return NotImplemented
    q, k, v = _in_projections(arguments)
    identity = IdentityProjection(q.shape[-1], q.dtype, q.device)
    out_weight, out_bias = arguments["out_proj_weight"], arguments.get("out_proj_bias")
    quantized_out = carries_quantizers(out_weight)
    arguments.update(
        query=q,
        key=k,
        value=v,
        in_proj_weight=None,
        in_proj_bias=None,
        use_separate_proj_weight=True,
        q_proj_weight=identity,
        k_proj_weight=identity,
        v_proj_weight=identity,
    )
    if quantized_out:
        arguments.update(out_proj_weight=identity, out_proj_bias=None)
    with torch._C.DisableTorchFunctionSubclass():
        attention, attention_weights = F.multi_head_attention_forward(*bound.args, **bound.kwargs)
    if quantized_out:
        attention = quantized_linear(attention, out_weight, out_bias)
    return attention, attention_weights


def _in_projections(arguments) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v as F.multi_head_attention_forward's body would compute them, each projection
    through `_project`. Self-attention projects once with the whole packed weight, as nn.Linear would."""
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    biases = arguments.get("in_proj_bias")
    biases = (None, None, None) if biases is None else biases.chunk(3)
    if arguments.get("use_separate_proj_weight", False):
        weights = [arguments[f"{name}_proj_weight"] for name in "qkv"]
        return tuple(_project(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
    weight, bias = arguments["in_proj_weight"], arguments.get("in_proj_bias")
    if query is key and key is value:
        return tuple(part.contiguous() for part in _project(query, weight, bias).chunk(3, dim=-1))
    _check_pieces_allowed(weight)
    embed = query.shape[-1]
    if key is value:
        w_q, w_kv = weight.split([embed, 2 * embed])
        b_q, b_kv = (None, None) if bias is None else bias.split([embed, 2 * embed])
        k, v = (part.contiguous() for part in _project(key, w_kv, b_kv).chunk(2, dim=-1))
        return _project(query, w_q, b_q), k, v
    return tuple(_project(x, w, b) for x, w, b in zip((query, key, value), weight.chunk(3), biases))


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if carries_quantizers(weight):
        return quantized_linear(x, weight, bias)
    with torch._C.DisableTorchFunctionSubclass():
        return F.linear(x, weight, bias)


def _check_pieces_allowed(weight) -> None:
    """Cross-attention projects pieces of the packed weight, each quantized on its own; a delayed
    scaling history would mix their amaxes."""
    quantizer = weight.linear_quantizers.weight if carries_quantizers(weight) else None
    if weight.quantized_at_use and quantizer is not None and quantizer.state_buffers():
        raise ValueError(
            f"{weight.linear_quantizers.parameter_name}: cross-attention (query is not key) projects the q, k "
            "and v pieces of the packed in_proj_weight separately, and one delayed-scaling history would mix "
            "their amaxes. Use current scaling (qtensor.recipes.float8_current()) for this layer, or keep it "
            "out of quantize_ with filter_fn."
        )


class IdentityProjection(torch.Tensor):
    """The [n, n] identity as a projection weight, never materialized: F.linear(x, I) is x.

    F.linear decomposes into t, mm / addmm (and dtype casts under autocast); each returns at once
    here. Any other op sees a real identity matrix."""

    @staticmethod
    def __new__(cls, n: int, dtype: torch.dtype, device: torch.device):
        return torch.Tensor._make_wrapper_subclass(cls, (n, n), dtype=dtype, device=device)

    def __init__(self, *args, **kwargs):
        pass

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None):
        return f"IdentityProjection({self.shape[0]}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in (aten.t.default, aten.detach.default, aten.alias.default, aten.conj.default) or (
            func is aten.transpose.int and isinstance(first, IdentityProjection)
        ):
            return IdentityProjection(first.shape[0], first.dtype, first.device)
        if func is aten._to_copy.default and set(kwargs) <= {"dtype", "device"}:
            return IdentityProjection(first.shape[0], kwargs.get("dtype", first.dtype), kwargs.get("device", first.device))
        if func is aten.mm.default and isinstance(args[1], IdentityProjection) and not isinstance(first, IdentityProjection):
            return first.clone()
        if func is aten.addmm.default and isinstance(args[2], IdentityProjection) and len(args) == 3 and not kwargs:
            return args[1] + args[0]
        real = tree_map_only(
            IdentityProjection, lambda i: torch.eye(i.shape[0], dtype=i.dtype, device=i.device), (args, kwargs)
        )
        return func(*real[0], **real[1])


