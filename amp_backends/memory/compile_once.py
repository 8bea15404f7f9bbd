"""An optimizer step that builds each ``torch.compile`` wrapper once, not once per parameter.

torchao's AdamW family (``torchao.optim._AdamW``, ``AdamW8bit``, ... with ``bf16_stochastic_round``)
updates one parameter at a time, calling ``torch.compile(single_param_adam, fullgraph=True,
dynamic=False)(...)`` inside its loop over parameters: every parameter of every step makes a new
compile wrapper (dynamo's backend lookup, inductor's config, the frame's trace-rule checks) before the
cached graph runs. Nothing recompiles (one graph per parameter shape, and torchao lifts dynamo's cache
limits around the loop), but the wrapper costs more host time than the update itself
(docs/memory.md, "The stochastic-rounding step", states it as measured).

:func:`compile_once` makes ``optimizer.step`` run with ``torch.compile`` memoised per function and
options: the first call builds the wrapper, every later one reuses it. The graphs, their guards and
what they compute are the same (dynamo keys its cache on the function's code, not on the wrapper):
the parameters after a step are bitwise those of the plain step with the same random state.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .. import patches

__all__ = ["compile_once", "compiled_once", "uses_compile_per_call"]

_LOCK = threading.RLock()


@contextlib.contextmanager
def compiled_once(cache: dict[Any, Any]) -> Iterator[None]:
    """Inside: ``torch.compile(fn, **options)`` returns the wrapper ``cache`` holds for ``(fn, options)``,
    made on first use. Options that cannot be keyed (unhashable) compile as usual."""
    with _LOCK:
        real = torch.compile

        def compile(model: Any = None, **options: Any) -> Any:
            if model is None:
                return lambda fn: compile(fn, **options)
            try:
                key = (model, tuple(sorted(options.items())))
                hash(key)
            except TypeError:
                return real(model, **options)
            if key not in cache:
                cache[key] = real(model, **options)
            return cache[key]

        with patches.replaced(torch, "compile", compile, scope="inside the optimizer's step",
                              cause="torchao's step compiles its update per parameter: each wrapper built once"):
            yield


def compile_once(optimizer: Any) -> Any:
    """Make ``optimizer.step`` build each compile wrapper once (see the module docstring); returns the
    optimizer. Its hooks, state and ``state_dict`` are untouched; twice is a no-op."""
    if getattr(optimizer.step, "_amp_compile_once", False):
        return optimizer
    step = optimizer.step
    cache: dict[Any, Any] = {}

    @functools.wraps(step)
    def stepped(*args: Any, **kwargs: Any) -> Any:
        with compiled_once(cache):
            return step(*args, **kwargs)

    stepped._amp_compile_once = True  # type: ignore[attr-defined]
    optimizer.step = stepped
    return optimizer


def uses_compile_per_call(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of torchao's per-parameter compiled optimizers (its step calls
    ``torch.compile`` once per parameter)."""
    return any(c.__module__.startswith("torchao.optim") and c.__name__ == "_AdamBase" for c in type(optimizer).__mro__)

