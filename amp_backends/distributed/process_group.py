"""torch.distributed with any backend: process-group setup from torchrun's environment.

    info = amp_backends.distributed.init_process_group("cuda")   # nccl; "cpu" -> gloo, "mlu" -> cncl
    model = DDP(model.to(info.device), device_ids=info.device_ids)
    scaler = be.grad_scaler(process_group="world")   # ranks with different gradients agree on found_inf

Launch: ``torchrun --nproc_per_node=N train.py`` (one node) or with ``--nnodes``,
``--node_rank`` and ``--rdzv_endpoint`` for several (docs/distributed.md).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..backend import Backend
from ..errors import AmpBackendsError
from ..registry.registry import get

__all__ = ["DistInfo", "init_process_group", "destroy_process_group"]

#: How long destroy_process_group leaves Gloo's worker threads to release finished work.
_SETTLE_S = 0.2
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its rank, the world size, and the device it trains on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dist_backend: str
    backend: Backend

    @property
    def device_ids(self) -> list[int] | None:
        """What DistributedDataParallel's ``device_ids`` wants: the local device, or None on CPU."""
        return None if self.device.type == "cpu" else [self.local_rank]

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_process_group(backend: str | Backend | None = None, **kwargs: Any) -> DistInfo:
    """Initialise the default process group for ``backend`` from torchrun's environment
    and place this rank on its local device. Extra keyword arguments go to
    ``torch.distributed.init_process_group``."""
    be = backend if isinstance(backend, Backend) else get(backend)
    if not be.dist_backend:
        hint = f"{be.dist_install_hint}; or " if be.dist_install_hint else ""
        raise AmpBackendsError(
            f"backend {be.name!r} has no torch.distributed process-group backend that can reduce "
            f"{be.device_type!r} tensors (gloo reduces cpu and cuda tensors only): {hint}train on one device, "
            "or pass backend='cpu' to run the ranks on CPUs"
        )
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise AmpBackendsError(
            f"init_process_group needs torchrun's environment ({', '.join(missing)} not set); launch with "
            "`torchrun --nproc_per_node=N your_script.py`"
        )
    rank, world, local = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if be.device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = be.device(local)
        module = getattr(torch, be.device_type, None)
        if hasattr(module, "set_device"):
            module.set_device(local)
    if not dist.is_available():
        raise AmpBackendsError("this torch build has no torch.distributed support")
    if not dist.is_initialized():
        dist.init_process_group(be.dist_backend, **kwargs)
    return DistInfo(rank, world, local, device, be.dist_backend, be)


def destroy_process_group() -> None:
    """Wait for every rank, tear the default process group down, and free it now.

    With torch 2.13 and Gloo, a process group still alive when the interpreter exits
    (DDP and autograd keep it in reference cycles) can abort the process during
    shutdown ("terminate called without an active exception"); collecting it here,
    while Python is fully alive, joins its threads cleanly.

    With torch 2.4 and Gloo, a worker thread still releasing a finished collective's tensors
    when the group is destroyed waits for the GIL that the destroying thread holds while it
    joins that worker: the process hangs. The pause after the barrier (the GIL released) lets
    the workers finish first.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        time.sleep(_SETTLE_S)
        dist.destroy_process_group()
        gc.collect()
