"""What a device is: the declarative contract a backend fills in, and the facts read from torch.

Owns the device contract (:mod:`.contract`), its optional capabilities (:mod:`.capabilities`), the
older spellings still honoured (:mod:`.old_contract`), what torch and the CPU say about the machine
(:mod:`.accelerator`, :mod:`.hardware`) and what a device's fused optimizer kernels do with
``found_inf`` (:mod:`.fused`). It runs no training work.

May import: :mod:`amp_backends.errors`, :mod:`amp_backends.torch_private` and torch. Nothing above it.
"""
