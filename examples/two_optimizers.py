"""Two models, two optimizers, one scaler: step each, then update once."""

import torch

import amp_backends
from _data import make_data, make_model

be = amp_backends.get()
x, y = make_data(be.device())
encoder = make_model(be.device())
head = torch.nn.Linear(1, 1).to(be.device())
opt_encoder = torch.optim.AdamW(encoder.parameters(), lr=1e-2)
opt_head = torch.optim.SGD(head.parameters(), lr=1e-2)
scaler = be.grad_scaler(torch.float16)

for _ in range(80):
    opt_encoder.zero_grad()
    opt_head.zero_grad()
    with be.autocast(torch.float16):
        loss = torch.nn.functional.mse_loss(head(encoder(x)), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt_encoder)  # e.g. to clip only the encoder
    torch.nn.utils.clip_grad_norm_(encoder.parameters(), 1.0)
    scaler.step(opt_encoder)  # each optimizer is skipped on its own inf/NaN
    scaler.step(opt_head)
    scaler.update()  # once per iteration, after every step
print(f"two optimizers: final_loss={loss.item():.4f} steps={scaler.stats.steps} skipped={scaler.stats.skipped}")
