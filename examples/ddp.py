"""The same loop under DistributedDataParallel: torchrun --nproc_per_node=2 examples/ddp.py

Works for cpu (gloo), cuda (nccl) and mlu (cncl): the backend names its process-group backend.
"""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from amp_backends import distributed
from _data import make_data, make_model

info = distributed.init_process_group()  # AMP_BACKEND picks the device; the best available otherwise
be = info.backend
x, y = make_data(info.device, shard=info.rank)  # each rank trains on its own shard
model = DDP(make_model(info.device), device_ids=info.device_ids)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = be.grad_scaler(torch.float16)

for _ in range(60):
    opt.zero_grad()
    with be.autocast(torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()  # DDP all-reduces the scaled gradients
    scaler.step(opt)
    scaler.update()

weights = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.empty_like(weights) for _ in range(info.world_size)]
torch.distributed.all_gather(gathered, weights)
if info.is_main:
    same = all(torch.equal(gathered[0], g) for g in gathered)
    print(f"ddp: world_size={info.world_size} backend={info.dist_backend} final_loss={loss.item():.4f} ranks_identical={same}")
distributed.destroy_process_group()
