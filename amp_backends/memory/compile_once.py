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

``optimizer.step`` becomes a method bound to the optimizer, as torch's own is: an LR scheduler made
before or after wraps it as it wraps torch's (its check that ``optimizer.step()`` ran before
``scheduler.step()`` included). The replacement is recorded (:mod:`amp_backends.patches`);
:func:`undo_compile_once` (``Lean.remove()``, where ``memory_lean`` applied it) ends it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from types import MethodType
from typing import Any

import torch

from .. import patches

__all__ = ["compile_once", "compile_once_patch", "compiled_once", "undo_compile_once", "uses_compile_per_call"]

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


#: What the patch of ``optimizer.step`` is recorded as doing.
_CAUSE = "torchao's step compiles its update per parameter: each compile wrapper built once (compile_once)"


def compile_once(optimizer: Any) -> Any:
    """Make ``optimizer.step`` build each compile wrapper once (see the module docstring); returns the
    optimizer. Its hooks, state and ``state_dict`` are untouched; twice is a no-op."""
    compile_once_patch(optimizer)
    return optimizer


def compile_once_patch(optimizer: Any) -> patches.Patch | None:
    """:func:`compile_once`, returning the patch of ``optimizer.step`` whose ``remove()`` ends it (None
    where it was on already: that one's owner ends it)."""
    if _patch_of(optimizer) is not None:
        return None
    previous = optimizer.step
    # the class's step (or one bound to this optimizer) is bound afresh to each call's optimizer, so that
    # the function holds no optimizer (the scheduler binds it to the optimizer it holds weakly); any other
    # callable (a scheduler's wrapper made before) is called as it is
    rebind = isinstance(previous, MethodType) and previous.__self__ is optimizer
    inner = previous.__func__ if rebind else previous
    cache: dict[Any, Any] = {}
    patch: patches.Patch | None = None

    @functools.wraps(inner)  # (an LR scheduler's wrapper made before: its marks carried, as it checks them)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        run = MethodType(inner, self) if rebind else inner
        if patch is not None and not patch.active:  # ended while a scheduler's wrapper still calls it
            return run(*args, **kwargs)
        with compiled_once(cache):
            return run(*args, **kwargs)

    # torch's LR schedulers wrap ``optimizer.step.__func__``: a method, as torch's own step is
    patch = patches.replace(optimizer, "step", MethodType(step, optimizer), cause=_CAUSE,
                            scope="until undo_compile_once() (Lean.remove(), where memory_lean applied it)")
    step._amp_compile_once = patch  # type: ignore[attr-defined]  # (copied onto a scheduler's wrapper made after)
    return patch


def _patch_of(optimizer: Any) -> patches.Patch | None:
    """The compile_once patch in force on ``optimizer.step`` (read through a scheduler's wrapper too, or,
    where the wrapper carries no marks (torch 2.4's), from the patches in force on the optimizer)."""
    patch = getattr(optimizer.step, "_amp_compile_once", None)
    if not isinstance(patch, patches.Patch):
        patch = patches.find(optimizer, "step")
        patch = patch if patch is not None and patch.cause == _CAUSE else None
    return patch if patch is not None and patch.active else None


def undo_compile_once(optimizer: Any) -> None:
    """End :func:`compile_once` on ``optimizer``: its step as before, or, where an LR scheduler wrapped
    it since, that wrapper left in place, calling the plain step."""
    patch = _patch_of(optimizer)
    if patch is not None:
        patch.remove()


def uses_compile_per_call(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of torchao's per-parameter compiled optimizers (its step calls
    ``torch.compile`` once per parameter)."""
    return any(c.__module__.startswith("torchao.optim") and c.__name__ == "_AdamBase" for c in type(optimizer).__mro__)

