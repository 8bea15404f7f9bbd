"""The plain AMP loop: the same code on every backend (cpu, cuda, mlu, or a vendor's)."""

import torch

import amp_backends
from _data import make_data, make_model

be = amp_backends.get()  # best available; AMP_BACKEND=cpu forces one
x, y = make_data(be.device())
model = make_model(be.device())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
loss_fn = torch.nn.MSELoss()

scaler = be.grad_scaler()  # dynamic loss scaling; a no-op where the dtype needs none
for _ in range(100):
    opt.zero_grad()
    with be.autocast():
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(f"backend={be.name} dtype={be.default_dtype} final_loss={loss.item():.4f} skipped={scaler.stats.skipped}")
