"""The scaler's gradient op: kernels, the executor that applies a device's limits, and the arena.

Owns the one op (unscale and inf/NaN check, with an optional sum of squares) on groups of
gradients that share a device and a dtype: the :class:`~.kernel.Kernel` interface and torch's
kernel (:mod:`.kernel`), the groups it runs on (:mod:`.groups`), the executor that honours what a
device declares (:mod:`.executor`), the flat gradient arena (:mod:`.arena`, with the param-group
lists that count their own changes, :mod:`.watched`) and the walk that finds an optimizer's gradients
(:mod:`.collect`).

May import: :mod:`amp_backends.devices`, :mod:`amp_backends.eager`, :mod:`amp_backends.patches`,
:mod:`amp_backends.torch_private` and torch.
"""
