"""Gradient accumulation: scale every micro-batch, unscale/step/update every N micro-batches."""

import torch

import amp_backends
from _data import make_data, make_model

be = amp_backends.get()
x, y = make_data(be.device())
model = make_model(be.device())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = be.grad_scaler(torch.float16)  # fp16 to show the scaler at work, even on CPU
accumulate = 4
micro = x.shape[0] // accumulate

for _ in range(40):
    for i in range(accumulate):
        xb, yb = x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]
        with be.autocast(torch.float16):
            loss = torch.nn.functional.mse_loss(model(xb), yb) / accumulate  # average over micro-batches
        scaler.scale(loss).backward()  # gradients add up, scaled by the same factor
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
print(f"accumulated {accumulate} micro-batches per step: final_loss={accumulate * loss.item():.4f} scale={scaler.get_scale():g}")
