"""What mixed precision will do to a model before it trains: ``check_model`` and ``detect_nonfinite``.

Owns the inspector (:mod:`.check`), what each module's forward put out in its runs (:mod:`.outputs`),
the loss scales it measures (:mod:`.scales`), its report (:mod:`.report`) and the inf/NaN watch for a
training step (:mod:`.nonfinite`).

May import: :mod:`amp_backends.memory`, :mod:`amp_backends.precision`, :mod:`amp_backends.tracing`,
:mod:`amp_backends.backend`, :mod:`amp_backends.registry`, :mod:`amp_backends.devices`,
:mod:`amp_backends.console`, :mod:`amp_backends.errors`, :mod:`amp_backends.torch_private` and torch.
"""
