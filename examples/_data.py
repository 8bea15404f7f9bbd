"""A small synthetic regression task shared by the examples (no download)."""

from __future__ import annotations

import torch


def make_data(
    device: torch.device, n: int = 512, features: int = 16, seed: int = 0, shard: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of one fixed function (set by ``seed``); ``shard`` draws a different sample."""
    w = torch.randn(features, 1, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1000 + shard + 1)
    x = torch.randn(n, features, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return x.to(device), y.to(device)


def make_model(device: torch.device, features: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(device)
