"""Gradient clipping: unscale first, so max_norm applies to the true gradients.

Two ways: torch's recipe (unscale_ then clip_grad_norm_), or the scaler's own
clip_grad_norm_, which unscales, checks and measures in one pass.
"""

import torch

import amp_backends
from _data import make_data, make_model

be = amp_backends.get()
x, y = make_data(be.device())

for recipe in ("torch", "scaler"):
    model = make_model(be.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = be.grad_scaler(torch.float16)
    for _ in range(60):
        opt.zero_grad()
        with be.autocast(torch.float16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if recipe == "torch":
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        else:
            norm = scaler.clip_grad_norm_(opt, max_norm=0.5)
        scaler.step(opt)  # skipped if the gradients held inf/NaN (the norm is then inf/NaN too)
        scaler.update()
    print(f"{recipe:>6} recipe: final_loss={loss.item():.4f} last_norm={norm.item():.4f}")
