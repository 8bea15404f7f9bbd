"""torchrun worker (2 CPU ranks): Lightning's Trainer with strategy="ddp" and AmpPrecision (fp16 on
the CPU). At batch --inject-step, rank --inject-rank's gradient turns inf before DDP's all-reduce."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import lightning as L
import torch

from amp_backends.integrations.lightning import AmpPrecision

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--inject-rank", type=int, default=1)
parser.add_argument("--inject-step", type=int, default=2)
args = parser.parse_args()
rank = int(os.environ["RANK"])


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.batches = 0
        if rank == args.inject_rank:
            self.net[0].weight.register_hook(
                lambda g: torch.full_like(g, math.inf) if self.batches == args.inject_step else g)
        self.record: list[dict] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        prec = self.trainer.precision_plugin
        self.record.append({"batch": self.batches, "skipped": prec.last_step_skipped, "scale": prec.scaler.get_scale()})
        self.batches += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
model = Regressor()
precision = AmpPrecision("cpu", torch.float16, init_scale=2.0**10, growth_interval=3)
trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp", plugins=[precision], max_epochs=1,
                    gradient_clip_val=0.5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
params = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.empty_like(params) for _ in range(2)]
torch.distributed.all_gather(gathered, params)
Path(args.out, f"rank{rank}.json").write_text(json.dumps({
    "record": model.record,
    "world_size": trainer.world_size,
    "identical_across_ranks": torch.equal(gathered[0], gathered[1]),
    "finite": bool(torch.isfinite(params).all()),
    "stats": {"skipped": precision.stats.skipped, "overflows": precision.stats.overflows},
}))
from amp_backends import distributed

distributed.destroy_process_group()  # barrier, destroy, collect: avoids Gloo's abort at exit
