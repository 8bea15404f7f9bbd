"""MLP blocks held in a ``ModuleList`` (each block ``x + down(act(up(x)))``, the MLP its own block, so the
activation's grandparent is the list, which is never called): for the MLP levers' tests and their FSDP2 worker."""

import torch
from torch import nn


class MlpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(self.act(self.up(h)))


class MlpBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MlpBlock(), MlpBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
