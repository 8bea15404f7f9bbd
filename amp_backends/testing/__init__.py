"""Testing support: the simulated PrivateUse1 device, simulated torch_mlu, torch_npu and
torch_musa, a simulated extension no plugin claims (torch_sim: the generic backend's device),
and the backend conformance suite (a pytest plugin, inert unless
``--amp-backend`` is given).

May import: :mod:`amp_backends.distributed`, :mod:`amp_backends.registry`, :mod:`amp_backends.gradients`,
:mod:`amp_backends.devices`, :mod:`amp_backends.torch_private` and torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


#: The simulated extensions, by backend name ("generic": the device "sim", which no plugin claims).
SIMULATED = {"mlu": "torch_mlu", "npu": "torch_npu", "musa": "torch_musa", "generic": "torch_sim"}


def sim_packages_path(backend: str = "mlu") -> Path:
    """A folder to put on ``sys.path`` so that ``import torch_<backend>`` finds the simulated one
    (one simulation per process: PrivateUse1 can be renamed once)."""
    if backend not in SIMULATED:
        raise ValueError(f"no simulated extension for {backend!r}: there are {', '.join(SIMULATED)}")
    return Path(__file__).resolve().parent / "sim_packages" / backend


def grad_op_(backend: Any, grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor | None = None,
             norm_sq: torch.Tensor | None = None) -> None:
    """The scaler's gradient op on a list of gradients (any mix of dtypes and layouts), exactly as
    training runs it: grouped by device and dtype, the limits the backend declares applied by the
    executor, the backend's kernel called (``inv_scale`` None: check only; ``norm_sq``: add the fp32
    sum of squares). What the conformance suite checks a device with."""
    from ..gradients import executor
    from ..gradients.collect import groups_of
    from ..registry.registry import kernel_for

    found = executor.run_on_groups_(backend, kernel_for(backend), groups_of(list(grads)), found_inf, inv_scale, norm_sq)
    for other in found.values():
        if other is not found_inf:
            found_inf.copy_(torch.maximum(found_inf, other.to(found_inf.device)))
