"""The study's model: a GPT-style byte-level decoder built from stock modules.

Learned positions, pre-norm blocks (RMSNorm, causal self-attention through
`F.scaled_dot_product_attention`, a SwiGLU feed-forward), a final RMSNorm and an output head over
the 256 byte values. Each block has four `nn.Linear` layers, the ones `qtensor.quantize_` quantizes:
`attention.qkv` (the three projections in one), `attention.out`, `mlp.gate_up` (gate and up in one)
and `mlp.down`. The default size (12 blocks, width 1024, feed-forward 2816) has 156M parameters.

Weights start as GPT-2's: normal with standard deviation 0.02, the projections that write into the
residual stream (`attention.out`, `mlp.down`) scaled by 1/sqrt(2 * blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    blocks: int = 12
    width: int = 1024
    heads: int = 16
    hidden: int = 2816  # the feed-forward width, about 8/3 of `width` as Llama's, a multiple of 128
    length: int = 1024  # the longest sequence
    vocabulary: int = 256


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width, bias=False)
        self.out = nn.Linear(config.width, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, length, width))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(config.width, 2 * config.hidden, bias=False)
        self.down = nn.Linear(config.hidden, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.width)
        self.attention = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.width)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocabulary, config.width)
        self.position = nn.Embedding(config.length, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.blocks))
        self.norm = nn.RMSNorm(config.width)
        self.head = nn.Linear(config.width, config.vocabulary, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.config.blocks)
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:
                std = residual_std if name.endswith(("attention.out.weight", "mlp.down.weight")) else 0.02
                nn.init.normal_(parameter, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parameter_count(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())
