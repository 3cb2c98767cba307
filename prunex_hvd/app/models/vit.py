"""A small Vision Transformer for 32×32 inputs (and smaller), written out so the package needs no torchvision.

Patch embedding by a strided conv (patch 4: 8×8 patches at 32×32, 4×4 at 16×16), a class token, learned
positions, pre-norm blocks of multi-head attention and a GELU MLP, a LayerNorm + linear head on the class token.
Attention keeps its query, key and value projections as separate ``nn.Linear`` layers (``q``, ``k``, ``v``) and
the output projection as ``proj``, with ``num_heads`` an attribute: ``head:K`` finds the heads there
(:func:`prunex_hvd.engine.dependencies.attention_heads`), and export can slice each projection and lower
``num_heads``. The MLP is ``fc1 → GELU → fc2``, a pair the ``torch.fx`` walk couples for ``neuron:K``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "Block", "Mlp", "VisionTransformer", "vit_tiny"]


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} does not split into {num_heads} heads")
        self.num_heads = num_heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        # head_dim from the weights (-1), not from dim: a slimmed export keeps fewer heads of the same size
        q = self.q(x).view(b, n, self.num_heads, -1).transpose(1, 2)
        k = self.k(x).view(b, n, self.num_heads, -1).transpose(1, 2)
        v = self.v(x).view(b, n, self.num_heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """``max_image_size``: the largest input side; a smaller input uses the top-left part of the position grid."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, patch: int = 4, dim: int = 128, depth: int = 4,
                 num_heads: int = 4, mlp_ratio: float = 2.0, max_image_size: int = 32):
        super().__init__()
        grid = max_image_size // patch
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, dim, grid, grid))
        self.cls_pos = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.Sequential(*[Block(dim, num_heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        for p in (self.cls_token, self.pos_embed, self.cls_pos):
            nn.init.trunc_normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)                                   # (B, dim, h, w)
        x = x + self.pos_embed[:, :, : x.shape[2], : x.shape[3]]
        x = x.flatten(2).transpose(1, 2)                          # (B, h·w, dim)
        cls = (self.cls_token + self.cls_pos).expand(x.shape[0], -1, -1)
        x = self.blocks(torch.cat([cls, x], dim=1))
        return self.head(self.norm(x[:, 0]))


def vit_tiny(num_classes: int = 10, in_channels: int = 3) -> VisionTransformer:
    """ViT for 32×32 inputs: patch 4, width 128, 4 blocks of 4 heads, MLP 256 (0.54M params for 10 classes)."""
    return VisionTransformer(num_classes=num_classes, in_channels=in_channels)
