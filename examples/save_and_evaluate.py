"""Save model, optimizer and scaler in one checkpoint, load it back, evaluate under autocast."""

import sys
import tempfile
from pathlib import Path

import torch

import amp_backends
from amp_backends import checkpoint
from _data import make_data, make_model

be = amp_backends.get()
x, y = make_data(be.device())
model = make_model(be.device())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = be.grad_scaler(torch.float16)
for _ in range(50):
    opt.zero_grad()
    with be.autocast(torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()

path = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()) / "example.ckpt"
checkpoint.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()}, kind="example")

restored = make_model(be.device())
opt2 = torch.optim.AdamW(restored.parameters(), lr=1e-2)
scaler2 = be.grad_scaler(torch.float16)
state = checkpoint.load(path, kind="example", required=("model", "optimizer", "scaler"))
restored.load_state_dict(state["model"])
opt2.load_state_dict(state["optimizer"])
scaler2.load_state_dict(state["scaler"])

restored.eval()
with torch.no_grad(), be.autocast(torch.float16):
    eval_loss = torch.nn.functional.mse_loss(restored(x), y).item()
same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), restored.state_dict().values()))
print(f"saved to {path}: eval_loss={eval_loss:.4f} identical_weights={same} scale={scaler2.get_scale():g}")
