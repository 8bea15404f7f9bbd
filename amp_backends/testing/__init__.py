"""Testing support: the simulated PrivateUse1 device, simulated torch_mlu, torch_npu and
torch_musa, a simulated extension no plugin claims (torch_sim: the generic backend's device),
and the backend conformance suite (a pytest plugin, inert unless
``--amp-backend`` is given)."""

from __future__ import annotations

from pathlib import Path


#: The simulated extensions, by backend name ("generic": the device "sim", which no plugin claims).
SIMULATED = {"mlu": "torch_mlu", "npu": "torch_npu", "musa": "torch_musa", "generic": "torch_sim"}


def sim_packages_path(backend: str = "mlu") -> Path:
    """A folder to put on ``sys.path`` so that ``import torch_<backend>`` finds the simulated one
    (one simulation per process: PrivateUse1 can be renamed once)."""
    if backend not in SIMULATED:
        raise ValueError(f"no simulated extension for {backend!r}: there are {', '.join(SIMULATED)}")
    return Path(__file__).resolve().parent / "sim_packages" / backend
