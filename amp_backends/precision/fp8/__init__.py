"""fp8 training for chosen Linear layers, with torchao as the engine.

Owns the engine's access and the device checks (:mod:`.engine`), the conversion of selected
layers and its undoing (:mod:`.convert`) and the Float8Linear that keeps the original parameters
(:mod:`.linear`).

May import: :mod:`amp_backends.precision.selectors`, :mod:`amp_backends.tracing`,
:mod:`amp_backends.devices`, :mod:`amp_backends.errors`.
"""
