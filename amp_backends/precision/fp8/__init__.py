"""fp8 training for chosen Linear layers, with torchao as the engine.

Owns the engine's access and the device checks (:mod:`.engine`), which Linear layers the fp8 layer
can take as they are and the user's ``fp8_convert`` (:mod:`.eligible`), the conversion of selected
layers and its undoing (:mod:`.convert`), what a converted layer carries over (hooks, and with fp8
all-gather the weight's parameter object: :mod:`.carry`) and the Float8Linear that keeps the original
parameters (:mod:`.linear`).

May import: :mod:`amp_backends.precision.selectors`, :mod:`amp_backends.tracing`,
:mod:`amp_backends.devices`, :mod:`amp_backends.errors`.
"""
