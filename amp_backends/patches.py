"""Reversible patches: every attribute the package replaces on an object it does not own (an optimizer's
``zero_grad``, a module's ``forward``, ``torch.compile``, a torch config flag, ``sys.stdout``), each
recorded with what it replaced, why (``cause``), for how long (``scope``), and its undo.

A feature applies its patch when it is turned on, never at import, and the feature's own undo
(``remove()``, ``release()``, a context's exit) removes it. :func:`active` lists the patches in force,
for tests and ``amp-backends info``.

- :func:`replace` sets an attribute and keeps what it replaced (an object's own attribute, or none: the
  class's then; a module's attribute as read); undone, that comes back, unless something replaced the
  attribute since (that replacement is left alone). Patches of one attribute may be undone in any
  order: a patch undone under a later :func:`replace` hands that one what it had kept, so the last
  undo puts back the value from before the first (two threads' overlapping ``with`` blocks).
- :func:`wrap` installs a wrapper that keeps what it wraps in its ``previous`` (None: the class's), as
  a module's ``forward`` wrapper does; :func:`unwrap` puts ``previous`` back where it is still installed.
- :func:`replaced` is :func:`replace` for the span of a ``with`` block; :func:`record` lists, for the
  span of a ``with`` block, a patch the caller applies itself (``contextlib.redirect_stdout``).

A patch holds the patched object and its new value weakly, and leaves :func:`active` when either is
collected; what :func:`replace` replaced it holds until the undo (a method bound to the patched object
through the object, so that an optimizer's or a module's own method never keeps it alive).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import MethodType, ModuleType
from typing import Any

#: The patches in force, in the order they were applied (a counter's value -> the patch).
_ACTIVE: dict[int, Patch] = {}
#: (id of the patched object, attribute) -> the keys in _ACTIVE of the patches on it, oldest first.
_ON: dict[tuple[int, str], list[int]] = {}
_ORDER = itertools.count()
_ABSENT = object()
#: Held while a patch is applied or undone, and while the tables change: patches of one attribute from
#: several threads (overlapping isolated runs) see each other whole. Reentrant: a patch dropped by the
#: garbage collector while this thread holds it.
_LOCK = threading.RLock()


def _weak(value: Any) -> Callable[[], Any]:
    """A reference to ``value`` that does not keep it alive where it can be weak (a bound method through
    its object); a value without weak references (a string, None) is held."""
    if isinstance(value, MethodType):
        return weakref.WeakMethod(value)
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def _same(current: Any, value: Any) -> bool:
    """Whether the attribute still holds the patch's value (a bound method is made afresh on each read)."""
    return current is value or (isinstance(value, MethodType) and current == value)


def _drop(key: int) -> None:
    with _LOCK:
        patch = _ACTIVE.pop(key, None)
        if patch is not None and patch.on is not None and key in _ON.get(patch.on, ()):
            _ON[patch.on].remove(key)
            if not _ON[patch.on]:
                del _ON[patch.on]


class Patch:
    """One patch in force: ``what`` was replaced, ``cause`` (why), ``scope`` (for how long), and
    :meth:`remove` (the undo)."""

    def __init__(self, what: str, cause: str, scope: str, undo: Callable[[], None], *holders: Any,
                 on: tuple[object, str] | None = None, value: Any = None) -> None:
        self.what, self.cause, self.scope = what, cause, scope
        self._undo: Callable[[], None] | None = undo
        self._key = next(_ORDER)
        #: (id of the patched object, attribute), for :func:`find`; the value put there, weakly
        self.on = (id(on[0]), on[1]) if on is not None else None
        self.value = _weak(value)
        #: what :func:`replace` replaced (None for other patches), which its undo puts back
        self.before: Callable[[], Any] | None = None
        with _LOCK:
            _ACTIVE[self._key] = self
            if self.on is not None:
                _ON.setdefault(self.on, []).append(self._key)
        self._watches: list[weakref.finalize] = []
        for held in holders:  # the patched object and the new value: the patch ends with either
            held = held.__self__ if isinstance(held, MethodType) else held
            if isinstance(held, ModuleType):
                continue  # a module lives as long as the process
            try:
                self._watches.append(weakref.finalize(held, _drop, self._key))
            except TypeError:
                pass  # no weak references (a string): held by the patch, nothing to watch

    @property
    def active(self) -> bool:
        return self._key in _ACTIVE

    def remove(self) -> None:
        """Undo the patch (once; a second call does nothing) and drop it from :func:`active`."""
        with _LOCK:
            _drop(self._key)
            for watch in self._watches:
                watch.detach()
            undo, self._undo = self._undo, None
            if undo is not None:
                undo()

    def __repr__(self) -> str:
        return f"<Patch {self.what} ({'active' if self.active else 'removed'}): {self.cause}; {self.scope}>"


def active() -> list[Patch]:
    """The patches in force, oldest first."""
    return list(_ACTIVE.values())


def find(target: object, name: str, value: Any = _ABSENT) -> Patch | None:
    """The latest patch in force on ``target.<name>`` (that put ``value`` there, where given), or None."""
    for key in reversed(_ON.get((id(target), name), ())):
        if value is _ABSENT or _same(_ACTIVE[key].value(), value):
            return _ACTIVE[key]
    return None


def describe(target: object, name: str) -> str:
    """``torch.compile``, ``SGD.zero_grad``, ``Linear.forward``: the attribute, by its owner's name."""
    owner = target.__name__ if isinstance(target, ModuleType) else type(target).__name__
    return f"{owner}.{name}"


def _current(owner: object, name: str) -> Any:
    return getattr(owner, name, _ABSENT) if isinstance(owner, ModuleType) else vars(owner).get(name, _ABSENT)


def replace(target: object, name: str, value: Any, *, cause: str, scope: str) -> Patch:
    """Set ``target.<name>`` to ``value``; the returned patch's ``remove()`` puts back what was there."""
    with _LOCK:
        own = _current(target, name)
        # a method bound to the target is kept through it, so that the patch never keeps the target alive
        before = _weak(own) if isinstance(own, MethodType) and own.__self__ is target else (lambda: own)
        setattr(target, name, value)
        target_ref, value_ref = _weak(target), _weak(value)
        # a value held weakly that is gone is no longer in the attribute: nothing to put back or hand on
        held = not isinstance(value_ref, weakref.ref)

        def undo() -> None:
            owner = target_ref()
            current = value_ref()
            if owner is None or (current is None and not held):
                return
            if not _same(_current(owner, name), current):
                _hand_on(owner, name, current, patch.before)
                return  # replaced since: that replacement is left alone
            kept = patch.before
            assert kept is not None  # (set below, before the patch can be undone)
            restored = kept()
            if restored is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, restored)

        patch = Patch(describe(target, name), cause, scope, undo, target, value, on=(target, name), value=value)
        patch.before = before
        return patch


def _hand_on(owner: object, name: str, value: Any, before: Callable[[], Any] | None) -> None:
    """A patch that put ``value`` there is undone while a later :func:`replace` of the attribute, which
    kept ``value``, is still in force: that one now keeps ``before`` instead, so its undo puts back what
    was there before either (not this patch's value, which nothing would ever remove)."""
    for key in _ON.get((id(owner), name), ()):
        later = _ACTIVE[key].before
        if later is not None and _same(later(), value):
            _ACTIVE[key].before = before
            return


def wrap(target: object, name: str, wrapper: Any, *, cause: str, scope: str) -> Patch:
    """Install ``wrapper`` as ``target.<name>`` (an instance attribute) and record it (:func:`track`)."""
    setattr(target, name, wrapper)
    return track(target, name, wrapper, cause=cause, scope=scope)


def track(target: object, name: str, wrapper: Any, *, cause: str, scope: str) -> Patch:
    """Record ``wrapper``, installed as ``target.<name>`` (by :func:`wrap`, or arrived with a copied
    model); ``wrapper.previous`` is what it wraps (the instance's own attribute before, or None: the
    class's). The patch's ``remove()`` is :func:`unwrap`."""
    target_ref, wrapper_ref = weakref.ref(target), weakref.ref(wrapper)

    def undo() -> None:
        owner, installed = target_ref(), wrapper_ref()
        if owner is not None and installed is not None:
            _unwrapped(owner, name, installed)

    return Patch(describe(target, name), cause, scope, undo, target, wrapper, on=(target, name), value=wrapper)


def _unwrapped(owner: object, name: str, wrapper: Any) -> None:
    previous = wrapper.previous
    if vars(owner).get(name) is not wrapper:
        return  # replaced since: that replacement is left alone
    if previous is None:
        del vars(owner)[name]
    else:
        setattr(owner, name, previous)


def unwrap(target: object, name: str, wrapper: Any) -> None:
    """Put ``wrapper.previous`` back as ``target.<name>`` where ``wrapper`` is still installed, and end
    its patch (a wrapper that came with a copied model, never recorded, is undone the same way)."""
    patch = find(target, name, wrapper)
    if patch is not None:
        patch.remove()
    _unwrapped(target, name, wrapper)


class Wrapped:
    """What a lever wrapped: each of ``modules`` has a :attr:`kind` wrapper installed as its ``forward``
    (by :func:`wrap`); :meth:`remove` unwraps those still installed, whatever was done to the modules since."""

    #: the wrapper class the lever installs
    kind: type

    def __init__(self, modules: list[Any]) -> None:
        self.modules = modules

    def remove(self) -> None:
        for module in self.modules:
            wrapper = vars(module).get("forward")
            if isinstance(wrapper, self.kind):
                unwrap(module, "forward", wrapper)
        self.modules = []


@contextlib.contextmanager
def replaced(target: object, name: str, value: Any, *, cause: str, scope: str = "inside the with block") -> Iterator[Patch]:
    """:func:`replace` on entry, undone on exit (also on an error)."""
    patch = replace(target, name, value, cause=cause, scope=scope)
    try:
        yield patch
    finally:
        patch.remove()


@contextlib.contextmanager
def stdout_to_stderr(cause: str) -> Iterator[Patch]:
    """``sys.stdout`` is ``sys.stderr`` inside the ``with`` block (``contextlib.redirect_stdout``), listed."""
    with record("sys.stdout", cause) as patch, contextlib.redirect_stdout(sys.stderr):
        yield patch


@contextlib.contextmanager
def record(what: str, cause: str, scope: str = "inside the with block") -> Iterator[Patch]:
    """List a patch the caller applies and undoes itself for the span of the ``with`` block."""
    patch = Patch(what, cause, scope, lambda: None)
    try:
        yield patch
    finally:
        patch.remove()
