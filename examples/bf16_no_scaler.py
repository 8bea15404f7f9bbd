"""bf16 needs no loss scaling: the scaler is free, and can still refuse non-finite steps."""

import math

import torch

import amp_backends
from _data import make_data, make_model

be = amp_backends.get("cpu")  # bf16 is the CPU default; cuda/mlu take bfloat16 where the chip has it
x, y = make_data(be.device())
model = make_model(be.device())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = be.grad_scaler(torch.bfloat16, check_finite=True)
assert not scaler.is_enabled()  # scale() returns the loss as it is; no unscale pass

for step in range(100):
    opt.zero_grad()
    with be.autocast(torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if step == 50:
        next(model.parameters()).grad[0, 0] = math.nan  # a bad batch
    scaler.step(opt)  # check_finite=True: this step is refused instead of poisoning the weights
    scaler.update()
finite = all(torch.isfinite(p).all() for p in model.parameters())
print(f"bf16: final_loss={loss.item():.4f} skipped={scaler.stats.skipped} weights_finite={finite}")
