"""The mark for tests that run on the simulated PrivateUse1 devices (amp_backends.testing)."""

from __future__ import annotations

import pytest
import torch
import torch.utils.backend_registration

needs_sim_device = pytest.mark.skipif(
    not hasattr(torch.utils.backend_registration, "_setup_privateuseone_for_python_backend"),
    reason="the simulated PrivateUse1 device needs torch.utils.backend_registration."
    f"_setup_privateuseone_for_python_backend, which torch {torch.__version__} lacks",
)
