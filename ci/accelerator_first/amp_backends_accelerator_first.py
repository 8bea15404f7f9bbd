"""A stand-in accelerator for the CI leg that runs the test suite as if the machine had one.

Installed only by putting this folder on PYTHONPATH (``ci/accelerator_first.sh``): a real
installed plugin (its ``*.dist-info`` declares the ``amp_backends`` entry point) whose backend,
``sim-accelerator``, is always available and ranks above every built-in, as CUDA does on a GPU
machine. The suite must pass with it: a test that silently assumes ``amp_backends.get()`` is the
cpu backend fails here, not first on a user's GPU machine. Its tensors live on the CPU (it runs
torch's CPU autocast and kernels): it stands in for the ranking, not for a device.
"""

from __future__ import annotations

import torch

import amp_backends


class SimAcceleratorBackend(amp_backends.Backend):
    name = "sim-accelerator"
    device_type = "cpu"
    default_dtype = torch.bfloat16
    priority = 1000

    def unavailable_reason(self) -> str | None:
        return None  # always available: it stands in for an accelerator's ranking


@amp_backends.hookimpl
def amp_backends_register_backends(register) -> None:  # type: ignore[no-untyped-def]  # pluggy's register callable is untyped
    register(SimAcceleratorBackend())
