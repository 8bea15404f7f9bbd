"""Running a model once to see what it does, without changing it.

Owns the recording of matmul-like ops and non-finite values (:mod:`.opcount`; which inf/NaN an op
produced: :mod:`.produced`), the attribution of each op to the module running it
(:mod:`.attribution`), and the isolation that leaves the model, its RNG, buffers and hooks as they
were (:mod:`.isolation`). Used by the precision recipe (to find
the head) and by the inspector.

May import: :mod:`amp_backends.patches`, :mod:`amp_backends.torch_private` and torch.
"""
