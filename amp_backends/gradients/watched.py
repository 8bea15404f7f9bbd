"""What an optimizer's param groups held when a flat gradient arena (:mod:`.arena`) was made, and
whether they still hold it: model surgery (``group["params"][i] = new``) seen without looking at
each parameter.

:func:`watch` puts a :class:`WatchedList` holding the same tensors, in the same order, in the
group's ``"params"``; every way Python has of changing a list in place (item and slice assignment,
``del``, ``append``, ``extend``, ``insert``, ``pop``, ``remove``, ``clear``, ``sort``, ``reverse``,
``+=``, ``*=``) adds one to its :attr:`~WatchedList.version` first. Whether a group still holds the
tensors it held is then one identity and one integer comparison, whatever the number of parameters.

A list someone else also holds (a reference taken before, through which they could change it) is
left in place: replacing it would leave their changes outside the optimizer. :func:`watch` says so
(None) and the caller compares that group's tensors one by one. A watched list pickles and copies
as a plain list.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ParamGroups", "WatchedList", "watch"]


class WatchedList(list):
    """A list whose :attr:`version` counts the in-place changes made to it through Python."""

    __slots__ = ("version",)

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self.version = 0

    def __reduce_ex__(self, protocol: Any) -> tuple[Callable[..., list], tuple[list]]:
        return list, (list(self),)  # a plain list: a pickle needs nothing of this package to load

    def __copy__(self) -> list:
        return list(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> list:
        import copy

        out: list = []
        memo[id(self)] = out
        out.extend(copy.deepcopy(item, memo) for item in self)
        return out


def _counted(name: str) -> Callable[..., Any]:
    method = getattr(list, name)

    def changed(self: WatchedList, *args: Any, **kwargs: Any) -> Any:
        self.version += 1
        return method(self, *args, **kwargs)

    changed.__name__ = changed.__qualname__ = name
    changed.__doc__ = method.__doc__
    return changed


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop",
              "remove", "clear", "sort", "reverse"):
    setattr(WatchedList, _name, _counted(_name))
del _name

#: ``sys.getrefcount`` of a group's list read into a local, when the group alone holds it.
_ALONE: list[int] = []


def _alone() -> int:
    if not _ALONE:
        group = {"params": [0]}
        current = group["params"]
        _ALONE.append(sys.getrefcount(current))
        del current
    return _ALONE[0]


def watch(group: dict[str, Any]) -> WatchedList | None:
    """The group's ``"params"`` as a :class:`WatchedList` (put in place of a plain list, same tensors,
    same order; one already watched is kept), or None where the list is not a plain list or someone
    besides the group holds it."""
    current = group["params"]
    if type(current) is WatchedList:
        return current
    if type(current) is not list or sys.getrefcount(current) > _alone():
        return None
    watched = WatchedList(current)
    del current
    group["params"] = watched
    return watched


class ParamGroups:
    """An optimizer's param groups as :func:`watch` left them: each group's list, the version seen
    (None: a list not watched), and a copy of what it held."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        watched = [watch(g) for g in optimizer.param_groups]
        self.lists = tuple(g["params"] for g in optimizer.param_groups)
        self.seen = [None if w is None else w.version for w in watched]
        self.copies = tuple(list(params) for params in self.lists)

    def unchanged(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether each param group is the list it was, holding the same tensors: one identity and one
        version comparison per watched group; the tensors compared by identity, in C, for a group not
        watched or whose version moved (a change made and undone, ``params[i] = params[i]``, passes)."""
        groups = optimizer.param_groups
        if len(groups) != len(self.lists):
            return False
        for k, (group, params) in enumerate(zip(groups, self.lists)):
            if group["params"] is not params:
                return False
            seen = self.seen[k]
            if seen is not None and params.version == seen:  # type: ignore[attr-defined]
                continue
            copy = self.copies[k]
            if len(params) != len(copy) or not all(map(operator.is_, params, copy)):
                return False
            if seen is not None:
                self.seen[k] = params.version  # type: ignore[attr-defined]
        return True

    def change(self, optimizer: torch.optim.Optimizer) -> str:
        """What :meth:`unchanged` found, and the way out (a walk: the per-tensor path's cost)."""
        groups = optimizer.param_groups
        detail = f"{len(groups)} param groups, {len(self.lists)} at flat_grads() (optimizer.add_param_group?)"
        for k, (group, params, copy) in enumerate(zip(groups, self.lists, self.copies)):
            current = group["params"]
            if current is not params or len(current) != len(copy):
                detail = f"param group {k}'s list of parameters was replaced or resized"
                break
            j = next((j for j, (a, b) in enumerate(zip(current, copy)) if a is not b), None)
            if j is not None:
                detail = (f"parameter {j} of param group {k} is another tensor (model surgery?), whose gradient "
                          "the arena does not hold")
                break
        return (f"the optimizer's parameters changed since flat_grads(): {detail}; call "
                "amp_backends.flat_grads(optimizer) again")
