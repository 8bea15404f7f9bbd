"""Where ``torch.compile`` stops: the scaler's work runs eagerly inside a compiled training step.

torch's own scaler lives in ``torch.amp``, a module dynamo never traces: a compiled step calls its
methods as plain Python (one graph break each) and compiles ``optimizer.step()`` on its own.
These decorators give this package's scaler the same treatment without importing dynamo at import
time (it is imported on first call, as torch's ``Optimizer.zero_grad`` imports it):

- :func:`eager`: the function and everything it calls run uncompiled (the gradient work: host reads,
  the kernels, the arena's checks);
- :func:`eager_frame`: the function's own frame is not traced, but what it calls is compiled as
  torch would compile it (``optimizer.step()`` called from the scaler's step);
- :func:`untraced`: like :func:`eager_frame`, with no wrapper and no cost per call, for functions
  called very often (the arena's hooks, once per parameter per backward); it imports dynamo at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .torch_private import DYNAMO_SKIP, resolve
from .torch_private import disable_dynamo as _disable_dynamo

__all__ = ["eager", "eager_frame", "untraced"]

F = TypeVar("F", bound=Callable[..., object])


def _disable(fn: Any, recursive: bool) -> Any:
    if _disable_dynamo is not None:
        return _disable_dynamo(fn, recursive=recursive)  # torch's disable() returns fn wrapped
    # a torch without it: the public disable, recorded as its fallback (it imports dynamo when applied)
    return torch.compiler.disable(fn, recursive=recursive)


def eager(fn: F) -> F:
    """Run ``fn``, and all it calls, outside torch.compile."""
    return _disable(fn, recursive=True)


def eager_frame(fn: F) -> F:
    """Do not trace ``fn``'s own frame; the functions it calls are compiled as usual."""
    return _disable(fn, recursive=False)


def untraced(fn: F) -> F:
    """Mark ``fn``'s code as never traced by dynamo; returns ``fn`` itself. What it calls is traced
    unless marked too: call only builtins and :func:`eager` functions from it. On a torch without
    dynamo's ``skip``, ``fn`` is returned unmarked (its recorded fallback: torch.compile traces it)."""
    skip = resolve(DYNAMO_SKIP)
    return fn if skip is None else skip(fn)  # dynamo's skip returns fn itself
