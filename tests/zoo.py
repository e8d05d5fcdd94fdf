"""Models for the multi-stream tests and benchmarks/multi_stream.py.

Each entry of :data:`ZOO` builds a model and inputs for a batch size on a
device. They cover the shapes multi-stream execution meets: annotated towers
(DeepRec's two-tower regression), a branchy block (Inception), many small
independent lookups (a recommendation model with 8 embedding-bag towers), a
chain with skip connections (residual MLP), a plain chain, in-place writes
and random ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import torch_stage


class TwoTowerRegression(nn.Module):
    """DeepRec's MultiStream example: two linear towers on streams 0 and 1,
    joined by a squared loss outside any stream scope."""

    def __init__(self, features: int = 64, hidden: int = 128):
        super().__init__()
        self.x_hidden = nn.Linear(features, hidden)
        self.x_out = nn.Linear(hidden, 1)
        self.y_hidden = nn.Linear(features, hidden)
        self.y_out = nn.Linear(hidden, 1)

    def forward(self, x, y, label):
        with torch_stage.stream(0):
            px = self.x_out(torch.relu(self.x_hidden(x)))
        with torch_stage.stream(1):
            py = self.y_out(torch.relu(self.y_hidden(y)))
        return ((px + py - label) ** 2).mean()


class InceptionBlock(nn.Module):
    """An Inception block: four branches over one input, concatenated."""

    def __init__(self, channels: int = 16):
        super().__init__()
        c = channels
        self.b1 = nn.Conv2d(c, c, 1)
        self.b2_reduce = nn.Conv2d(c, c // 2, 1)
        self.b2 = nn.Conv2d(c // 2, c, 3, padding=1)
        self.b3_reduce = nn.Conv2d(c, c // 4, 1)
        self.b3_a = nn.Conv2d(c // 4, c // 2, 3, padding=1)
        self.b3_b = nn.Conv2d(c // 2, c // 2, 3, padding=1)
        self.b4_pool = nn.MaxPool2d(3, stride=1, padding=1)
        self.b4 = nn.Conv2d(c, c // 2, 1)

    def forward(self, x):
        a = F.relu(self.b1(x))
        b = F.relu(self.b2(F.relu(self.b2_reduce(x))))
        c = F.relu(self.b3_b(F.relu(self.b3_a(F.relu(self.b3_reduce(x))))))
        d = F.relu(self.b4(self.b4_pool(x)))
        return torch.cat([a, b, c, d], dim=1)


class RecModel(nn.Module):
    """Eight embedding-bag towers and a dense bottom MLP, concatenated into a
    top MLP (DLRM-like)."""

    TABLES = 8

    def __init__(self, rows: int = 1000, dim: int = 16, dense: int = 13):
        super().__init__()
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(self.TABLES)
        )
        self.projections = nn.ModuleList(nn.Linear(dim, dim) for _ in range(self.TABLES))
        self.bottom = nn.Sequential(nn.Linear(dense, 32), nn.ReLU(), nn.Linear(32, dim))
        self.top = nn.Sequential(
            nn.Linear(dim * (self.TABLES + 1), 64), nn.ReLU(), nn.Linear(64, 1)
        )

    def forward(self, dense, indices, offsets):
        features = [self.bottom(dense)]
        for i in range(self.TABLES):
            pooled = self.tables[i](indices[i], offsets[i])
            features.append(torch.relu(self.projections[i](pooled)))
        return torch.sigmoid(self.top(torch.cat(features, dim=1)))


class ResidualMLP(nn.Module):
    """Three residual blocks: every skip edge is implied by the block path,
    so the whole model is one chain."""

    def __init__(self, width: int = 64, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return self.head(x)


def plain_chain(width: int = 64) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
    )


class InPlaceModel(nn.Module):
    """Two branches with in-place writes, a read before a write on another
    branch (write-after-read), a constant written through item assignment
    and through a view, a constant both branches read, and an in-place
    ReLU."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.left = nn.Linear(width, width)
        self.right = nn.Linear(width, width)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        scale = torch.ones_like(x)
        a = self.left(x) * scale
        b = self.right(x) * scale
        snapshot = a * 2  # reads a before the write below
        a.add_(1.0)
        b.mul_(0.5)
        buf = torch.zeros_like(x)
        buf[0] = b[0]
        buf.narrow(0, 1, 1).copy_(a.narrow(0, 1, 1))
        c = self.act(b + buf)
        torch.relu_(a)
        return a.sum(dim=1) + c.sum(dim=1) + snapshot.sum(dim=1)


class RandomBranches(nn.Module):
    """Dropout and random noise in two independent branches."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.left = nn.Linear(width, width)
        self.right = nn.Linear(width, width)

    def forward(self, x):
        a = F.dropout(self.left(x), p=0.5, training=True)
        b = self.right(x) + torch.randn_like(x)
        return a * b


@dataclass
class Entry:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, str], Tuple[torch.Tensor, ...]]
    random: bool = False
    # The smallest batch the model accepts (in_place writes rows 0 and 1).
    min_batch: int = 1


def _two_tower_inputs(batch: int, device: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 64, generator=g)
    y = torch.randn(batch, 64, generator=g)
    label = torch.randn(batch, 1, generator=g)
    return tuple(t.to(device) for t in (x, y, label))


def _image_inputs(batch: int, device: str):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, 16, 8, 8, generator=g).to(device),)


def _rec_inputs(batch: int, device: str, bag: int = 4):
    g = torch.Generator().manual_seed(2)
    dense = torch.randn(batch, 13, generator=g)
    indices = torch.randint(0, 1000, (RecModel.TABLES, batch * bag), generator=g)
    offsets = torch.arange(0, batch * bag, bag).repeat(RecModel.TABLES, 1)
    return tuple(t.to(device) for t in (dense, indices, offsets))


def _vector_inputs(width: int):
    def make(batch: int, device: str):
        g = torch.Generator().manual_seed(3)
        return (torch.randn(batch, width, generator=g).to(device),)

    return make


ZOO = [
    Entry("two_tower", TwoTowerRegression, _two_tower_inputs),
    Entry("inception", InceptionBlock, _image_inputs),
    Entry("rec_8_towers", RecModel, _rec_inputs),
    Entry("residual_mlp", ResidualMLP, _vector_inputs(64)),
    Entry("plain_chain", plain_chain, _vector_inputs(64)),
    Entry("in_place", InPlaceModel, _vector_inputs(32), min_batch=2),
    Entry("random_branches", RandomBranches, _vector_inputs(32), random=True),
]


def build(entry: Entry, device: str = "cpu") -> nn.Module:
    """The entry's model with fixed weights, on ``device``."""
    torch.manual_seed(1234)
    return entry.build().to(device)
