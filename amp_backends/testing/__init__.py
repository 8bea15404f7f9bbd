"""Testing support: the simulated PrivateUse1 device, a simulated torch_mlu, and the
backend conformance suite (a pytest plugin, inert unless ``--amp-backend`` is given)."""

from __future__ import annotations

from pathlib import Path


def sim_packages_path() -> Path:
    """A folder to put on ``sys.path`` so that ``import torch_mlu`` finds the simulated one."""
    return Path(__file__).resolve().parent / "sim_packages"
