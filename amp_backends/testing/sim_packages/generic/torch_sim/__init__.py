"""A simulated out-of-tree accelerator "sim" with no amp_backends plugin at all (testing only).

It stands for a vendor extension that only plugs into torch: PrivateUse1 renamed "sim",
``torch.sim`` its device module, and a ``torch.backends`` entry point (the dist-info folder next
to this package) so that ``import torch`` autoloads it (torch 2.5+, ``TORCH_DEVICE_BACKEND_AUTOLOAD``).
amp_backends reaches it through the generic backend alone: ``torch.accelerator`` reports it.

``AMP_SIM_GENERIC_DTYPES``: what the device module's ``get_amp_supported_dtype`` lists
(``float16,bfloat16`` by default; ``none`` for an empty list: autocast takes no dtype).
``AMP_SIM_GENERIC_UNSCALE=0``: the extension gives torch's unscale op no kernel for the device.
"""

from __future__ import annotations

import os

import torch

from amp_backends.testing import simdevice

_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_LISTED = os.environ.get("AMP_SIM_GENERIC_DTYPES", "float16,bfloat16")
DTYPES = [] if _LISTED == "none" else [_NAMES[n.strip()] for n in _LISTED.split(",") if n.strip()]


class _SimModule(simdevice._DeviceModule):
    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return list(DTYPES)


def _install() -> None:
    if simdevice.installed_name() == "sim":
        return
    no_unscale = os.environ.get("AMP_SIM_GENERIC_UNSCALE", "1") == "0"
    simdevice.install(
        "sim",
        bf16=torch.bfloat16 in DTYPES,
        unscale_dtypes=() if no_unscale else None,
        unscale_message=("Could not run 'aten::_amp_foreach_non_finite_check_and_unscale_' with arguments from "
                         "the 'sim' backend ({dtype})"),
        module_class=_SimModule,
    )


def _autoload() -> None:
    """torch's ``torch.backends`` entry point: called by ``import torch``."""
    _install()


_install()
