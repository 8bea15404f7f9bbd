"""Saved tensors substituted: what an op saves for backward stored as another tensor it is made from.

A lever tags a tensor with its *source* and how to remake it (:func:`substitute`): an activation's
output with the activation's input and its function (:mod:`.activation_outputs`), an up-projection's
output with its input and the layer's op (:mod:`.activation_inputs`). From the tagging until the tagged
tensor is saved, at the latest to the end of the forward of the owner block it happened in
(:func:`open_scope`), a ``saved_tensors_hooks`` pair stores, in place
of a tagged tensor or a view of it that an op saves, its source, and remakes the tensor from it when the backward asks (the remaking runs with
autocast off, so it is the same kernel on the same input: bitwise what was saved). The hooks see only
the saves from a tag to its consumer's, and the one save after: each costs a Python call at the forward
and one at the backward. An op that saves a tagged tensor twice (``h * h``) has both saves substituted;
a second consumer that saves it after other saves were made keeps the tensor itself, and then the first
substitution saves nothing (a scope held open to the block's end would pass every later save through
Python). Which saves are substituted follows from the saves alone, the same in a forward and in a
non-reentrant checkpoint's recomputation of it (which matches the saves by their order).

Composes with the hooks already in force (torch's checkpoint, ``save_on_cpu``, the memory ledger): what
it does not replace goes to them as before, and for a tagged tensor they are handed the source instead.
It asks torch which hooks are in force (``torch._C._autograd._top_saved_tensors_default_hooks``; torch
2.4 has none, and there nothing is substituted: :func:`available`). It does nothing under
``torch.compile`` (the compiler decides what to save) nor where saved-tensor hooks are disabled. A
source edited in place between the forward and the backward is refused at the backward
(:class:`SubstituteSourceEdited`), as autograd refuses an edited saved tensor. Under hooks in force
before, only contiguous tensors are substituted (``save_on_cpu(pin_memory=True)`` stores a contiguous
copy, and the op's backward then runs on that layout); the levers stand aside on a module with others'
hooks (:func:`others_hooked`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdRef
from torch import nn

from .. import torch_private
from ..errors import AmpBackendsError
from .hooks_around import _ASIDE, foreign_forward, leaves_alone, others_hooked, stand_aside

__all__ = ["Hooked", "HooksOver", "SubstituteSourceEdited", "at_block_end", "available", "can_open", "closing", "foreign_forward",
           "leaves_alone", "open_scope", "others_hooked", "outermost", "owner_name", "owners", "stand_aside", "substitute", "tagged"]


class SubstituteSourceEdited(AmpBackendsError, RuntimeError):
    """The tensor a saved tensor is remade from was edited in place between the forward and the backward."""


def available() -> bool:
    """Whether this torch lets saved tensors be substituted (it can tell which hooks are in force)."""
    return torch_private.top_saved_tensors_hooks is not None and torch_private.saved_tensors_hooks_are_enabled is not None


class _Remade:
    """A tag's remaking, shared by every save that needs it, and by the remakings chained on it (a tagged
    tensor whose source is itself tagged): made once a backward and kept from its first use to its last."""

    __slots__ = ("inner", "make", "value", "waiting")

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor], inner: _Remade | None = None) -> None:
        self.make, self.inner = make, inner
        self.value: torch.Tensor | None = None
        #: uses expected and not yet made: a save packed through it, or a remaking chained on it (made once, it uses it once)
        self.waiting = 0

    def expect(self) -> None:
        """One more use to come (a save packed through it): the first also makes one of the remaking it is chained on."""
        self.waiting += 1
        if self.waiting == 1 and self.inner is not None:
            self.inner.expect()

    def __call__(self, source: torch.Tensor) -> torch.Tensor:
        value = self.value
        if value is None:
            value = self.make(source)
        self.waiting -= 1
        self.value = value if self.waiting > 0 else None
        return value


class _Chain:
    """``make`` of what ``first`` remakes (or of the view of it ``view`` was): a tag's remaking through its source's tag."""

    __slots__ = ("first", "geometry", "make")

    def __init__(self, first: _Remade, make: Callable[[torch.Tensor], torch.Tensor], view: torch.Tensor) -> None:
        self.first, self.make = first, make
        base = view._base
        self.geometry = None if base is None else (
            view.size(), view.stride(), view.storage_offset() - base.storage_offset())

    def __call__(self, source: torch.Tensor) -> torch.Tensor:
        value = self.first(source)
        if self.geometry is not None:
            size, stride, offset = self.geometry
            value = value.as_strided(size, stride, value.storage_offset() + offset)
        return self.make(value)


class _Tag:
    """A tagged tensor's source, how it is remade (through its shared remaking), and its version at the tagging."""

    __slots__ = ("remade", "source", "source_version", "tensor", "version", "what")

    def __init__(self, tensor: torch.Tensor, source: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor],
                 what: str, chain: bool) -> None:
        self.tensor = WeakIdRef(tensor, functools.partial(_forget, id(tensor)))
        self.version, self.what = tensor._version, what
        self.remade: _Remade
        self.source: torch.Tensor
        base = source if source._base is None else source._base
        inner = _TAGS.get(id(base)) if chain else None
        if inner is not None and inner.live(base):  # the source is remade from another: store that one
            self.remade = _Remade(_Chain(inner.remade, make, source), inner.remade)
            self.source, self.what = inner.source, inner.what
        else:
            self.remade = _Remade(make)
            self.source = source
        self.source_version = self.source._version

    def live(self, tensor: torch.Tensor) -> bool:
        """Whether this tag is ``tensor``'s and neither it nor the source was edited since the tagging."""
        return self.tensor() is tensor and tensor._version == self.version and self.source._version == self.source_version


#: id of a live tagged tensor -> its tag
_TAGS: dict[int, _Tag] = {}


def _forget(key: int, _ref: Any) -> None:
    _TAGS.pop(key, None)


def substitute(tensor: torch.Tensor, source: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor],
               what: str, chain: bool = True) -> None:
    """Let ``tensor`` (not a view) be saved as ``source`` and remade by ``make(source)`` while a scope
    runs; ``what`` names the source in errors.
    The tag holds ``source`` as long as ``tensor`` lives, and ends if either is edited in place. Where
    ``source`` is itself tagged (the output of a layer whose input remakes it) and ``chain``, ``tensor`` is
    saved as that tag's source and remade through both, the inner remaking shared with the source's own
    saves (one remaking a backward, kept from the first of them to unpack to the last); without
    ``chain``, as ``source`` itself."""
    _TAGS[id(tensor)] = _Tag(tensor, source, make, what, chain)


def tagged(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or the tensor it is a view of) is tagged, neither it nor its source edited since."""
    base = tensor if tensor._base is None else tensor._base
    tag = _TAGS.get(id(base))
    return tag is not None and tag.live(base)


class _Stored:
    """What is stored in place of a tagged tensor (or a view of it): the source, packed by the hooks beneath, and the view's place."""

    __slots__ = ("base_layout", "make", "offset", "packed", "scope", "size", "source", "source_layout", "stride",
                 "tensor", "tensor_version", "version", "what")

    def __init__(self, scope: _Scope, packed: Any, tag: _Tag, view: torch.Tensor, base: torch.Tensor) -> None:
        self.scope, self.packed, self.make, self.what = scope, packed, tag.remade, tag.what
        self.tensor, self.tensor_version = tag.tensor, base._version  # (the saved tensor: edited, refused as autograd does)
        self.source, self.version = WeakIdRef(tag.source), tag.source._version
        self.source_layout = (tag.source.size(), tag.source.stride())
        self.size, self.stride = view.size(), view.stride()
        self.offset = view.storage_offset() - base.storage_offset()  # where the view starts in the tensor
        self.base_layout = (base.size(), base.stride())

    def remake(self, source: torch.Tensor) -> torch.Tensor:
        """The saved view, remade from ``source``. Hooks beneath may hand the source back in another layout
        (``save_on_cpu`` stores it contiguous): it is put back in its own first, so that the remaking runs the
        same kernel on the same layout (bitwise what was saved, in the tagged tensor's layout, the view's)."""
        source = _laid_out(source, self.source_layout)
        if torch.is_autocast_enabled(source.device.type):  # a backward run inside autocast: not for this
            with torch.autocast(source.device.type, enabled=False):
                value = self.make(source)
        else:
            value = self.make(source)  # under create_graph grad mode is on: differentiable, as saved
        value = _laid_out(value, self.base_layout)  # the kernel's own choice of layout, should it differ
        if value.size() == self.size and value.stride() == self.stride and self.offset == 0:
            return value
        return value.as_strided(self.size, self.stride, value.storage_offset() + self.offset)


def _laid_out(t: torch.Tensor, layout: tuple[torch.Size, tuple[int, ...]]) -> torch.Tensor:
    """``t`` with the size and strides ``layout`` gives (a copy where they differ)."""
    if (t.size(), t.stride()) == layout:
        return t
    return torch.empty_strided(*layout, dtype=t.dtype, device=t.device).copy_(t)


def can_open() -> bool:
    """Whether saved-tensor hooks can be put in force over those in force here: this torch tells which are
    (:func:`available`), nothing is being compiled, grad is on and the hooks are not disabled (``torch.func``)."""
    return (available() and not torch.compiler.is_compiling() and torch.is_grad_enabled()
            and torch_private.saved_tensors_hooks_are_enabled())


class HooksOver:
    """A ``saved_tensors_hooks`` pair over the hooks in force when it was made (or none): what it does not
    store itself it passes on to those (:meth:`pass_on`, :meth:`unpack_outer`); it comes out of force
    where it is the innermost (:meth:`close`). Subclasses write :meth:`pack` and :meth:`unpack`."""

    def __init__(self, outer: tuple[Callable[..., Any], Callable[..., Any]] | None) -> None:
        self.outer_pack: Callable[[torch.Tensor], Any] | None = outer[0] if outer is not None else None
        self.outer_unpack: Callable[[Any], torch.Tensor] | None = outer[1] if outer is not None else None
        self.closed = False

    def pack(self, t: torch.Tensor) -> Any:
        raise NotImplementedError

    def unpack(self, packed: Any) -> torch.Tensor:
        raise NotImplementedError

    def enter(self) -> None:
        """Put the hooks in force (what ``saved_tensors_hooks.__enter__`` does, without its object: torch's
        stack of hooks holds the bound pair until :meth:`exit`, and nothing else refers back to them)."""
        torch_private.push_saved_tensors_hooks(self.pack, self.unpack)

    def close(self) -> None:
        """Take the hooks out of force where they are the innermost (hooks put in force over them are not
        touched, and these stay until those are gone)."""
        if _top_pack() == self.pack:
            self.exit()

    def exit(self) -> None:
        """Take the hooks out of force, once (torch's stack then drops the bound pair: nothing keeps the
        hooks beneath alive, a checkpoint's frame or the ledger's, until a collection)."""
        if not self.closed:
            self.closed = True
            torch_private.pop_saved_tensors_hooks()

    def pass_on(self, t: torch.Tensor) -> Any:
        """A save not stored here, to the hooks beneath; where there are none, detached: a saved output
        handed back as it is would hold its own grad_fn, a cycle through C++ that no collection frees where
        the graph never runs backward (autograd gives the unpacked tensor its grad_fn again). With its
        version: autograd checks none under hooks, and :meth:`unpack_outer` refuses an edit as it would."""
        return _Passed(t.detach(), t._version) if self.outer_pack is None else self.outer_pack(t)

    def unpack_outer(self, packed: Any) -> torch.Tensor:
        """What :meth:`pass_on` stored (or the hooks beneath packed), unpacked: an edit in place since the
        save refused, as autograd refuses it (a weight an optimizer stepped between forward and backward)."""
        if self.outer_unpack is not None:
            return self.outer_unpack(packed)
        if type(packed) is not _Passed:
            return packed  # (a tensor of the hooks' own)
        _unedited(packed.tensor, packed.version)
        return packed.tensor


def _unedited(t: torch.Tensor, version: int) -> None:
    """Refuse ``t`` edited in place since it was saved at ``version``, with autograd's own error (which
    autograd does not raise for a save made under hooks)."""
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} instead "
            "(saved under a memory_lean lever's saved-tensor hooks; edit a copy, or step after the backward)")


class _Passed:
    """A save passed on with no hooks beneath: the tensor detached, and its version at the save."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor, self.version = tensor, version


class _Scope(HooksOver):
    """The pack and unpack hooks of one scope, over the hooks in force when it began (or none). It is
    done (:meth:`_close_after_consumer`) at the first save of another tensor once each tag made for it
    was substituted (:attr:`pending` empty), so that the rest of the block's saves cost no Python call."""

    def __init__(self, outer: tuple[Callable[..., Any], Callable[..., Any]] | None) -> None:
        super().__init__(outer)
        #: ids of the tagged tensors made for this scope and not yet saved
        self.pending: set[int] = set()
        #: past its consumer's save: every later save passed on, whether or not the hooks left force
        self.done = False
        self.task = _graph_task()  # the graph task it was entered in (-1: none)

    def pack(self, t: torch.Tensor) -> Any:
        if self.done or (t.is_nested and t.layout == torch.strided):  # (torch's first nested layout: no strides)
            return self.pass_on(t)
        base = t if t._base is None else t._base
        tag = _TAGS.get(id(base))
        if (tag is None or tag.tensor() is not base or base._version != tag.version or t.dtype != base.dtype
                or tag.source._version != tag.source_version):  # either edited since: saved as it is
            if not self.pending:
                self._close_after_consumer()
            return self.pass_on(t)
        source = tag.source
        if self.outer_pack is not None and not (t.is_contiguous() and source.is_contiguous()):
            # Hooks in force before may store a tensor in another layout (save_on_cpu stores it contiguous), and
            # the op's backward runs on that layout: a tensor not contiguous is theirs (a remade copy keeps its strides).
            return self.outer_pack(t)
        stored = _Stored(self, source if self.outer_pack is None else self.outer_pack(source), tag, t, base)
        tag.remade.expect()
        self.pending.discard(id(base))
        return stored

    def _close_after_consumer(self) -> None:
        """Every tag made for this scope saved, and now a save of another tensor: the consumer's op is past
        saving its tagged input (an op that saves it twice, ``h * h``, saves it back to back), so the block's
        later saves go to the hooks below. Done by the saves alone, the same in a forward and in a checkpoint's
        recomputation (which matches saves by their order); out of force only in the graph task it was entered
        in (from a backward run during the forward, the engine restores the hooks after its node)."""
        self.done = True
        if self.task is not None and _graph_task() == self.task:
            self.close()

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Stored) or packed.scope is not self:
            return self.unpack_outer(packed)
        saved = packed.tensor()
        if saved is not None:
            _unedited(saved, packed.tensor_version)
        source: torch.Tensor = self.unpack_outer(packed.packed)
        if source is packed.source() and source._version != packed.version:
            raise SubstituteSourceEdited(
                f"{packed.what} ({tuple(source.shape)}, {source.dtype}) was edited in place after the forward "
                f"(version {packed.version} -> {source._version}); the tensor the backward needs is remade "
                "from it and would be wrong: edit a copy (x = x.clone()), or turn the memory_lean lever that "
                "saves it this way off")
        return packed.remake(source)


def _graph_task() -> int | None:
    """The graph task running on this thread (-1 outside any backward), None where torch cannot tell."""
    task = torch_private.current_graph_task_id
    return task() if task is not None else None


_LOCAL = threading.local()


def _scopes() -> list[list[Any]]:
    """This thread's running owners, each ``[a module's id, the scope opened inside it (or None yet), the
    saved-tensor pack hook in force when it began, what to call when it ends]``."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def _top_pack() -> Any:
    top = torch_private.top_saved_tensors_hooks
    hooks = top(False) if top is not None else None
    return hooks[0] if hooks is not None else None


def _new_scope() -> _Scope | None:
    """Hooks over those in force, entered; None where none can be (compiling, no grad, hooks disabled or
    unknown on this torch) or where a scope is in force already (it substitutes every tag)."""
    if not can_open():
        return None
    outer = torch_private.top_saved_tensors_hooks(False)
    if outer is not None and isinstance(getattr(outer[0], "__self__", None), _Scope):
        return None
    scope = _Scope(outer)
    scope.enter()
    return scope


def _unwind(key: int | None) -> None:
    """Close this thread's entries down to ``key``'s (all of them for None), where one is on the stack: a
    module's forward that a BaseException ended (a KeyboardInterrupt: torch runs always-call forward hooks
    for an Exception only) left them open. A scope's hooks are taken out of force where they are still the
    innermost; hooks put in force over them since are not touched."""
    stack = _scopes()
    if key is not None and all(entry[0] != key for entry in stack):
        return
    while stack:
        entry, scope, _, ends = stack.pop()
        if scope is not None:
            scope.close()
        for end in ends:
            end()
        if entry == key:
            return


def at_block_end(end: Callable[[], None]) -> bool:
    """Call ``end`` when the innermost running owner's forward ends (also where it raised); False, and
    nothing done, where no owner runs."""
    stack = _scopes()
    if stack:
        stack[-1][3].append(end)
    return bool(stack)


def _running(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of an owner: it runs; a scope may be opened inside it (:func:`open_scope`)."""
    if not torch.compiler.is_compiling():
        stack = _scopes()
        if stack:  # (else nothing to unwind: the usual case, an owner running outside any other)
            _unwind(id(module))  # its entry still there: its last forward was interrupted
        stack.append([id(module), None, _top_pack(), []])


def open_scope(tagged: torch.Tensor) -> None:
    """Substitute tagged tensors from now until ``tagged`` (just tagged) is saved, at the latest until the
    innermost running owner's forward ends (a tag made inside it, an activation's output, is saved by a
    later op of the same block). Nothing where no owner runs (its forward called directly, without its
    hooks, as a checkpoint's recomputation calls it), or other saved-tensor hooks were put in force inside
    the owner (a checkpoint of its forward: which saves it keeps is then its own, the same in the forward
    and its recomputation). A scope open already takes ``tagged`` as well."""
    stack = _scopes()
    if not stack:
        return
    scope = stack[-1][1]
    if scope is not None and scope.done and not scope.closed:
        scope.done = False  # done where it could not be taken out of force: opened again, as a new one would be
    elif scope is None or scope.closed:
        if _top_pack() is not stack[-1][2]:
            return
        scope = _new_scope()
        if scope is None:
            return
        stack[-1][1] = scope
    scope.pending.add(id(tagged))


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of an owner (also run when the forward raised): close what it opened."""
    if torch.compiler.is_compiling():
        return
    stack = _scopes()
    if stack and stack[-1][0] == id(module):  # else nothing was pushed for it (or its pre-hook never ran)
        _, scope, _, ends = stack.pop()
        if scope is not None:
            scope.exit()
        for end in ends:
            end()


def owner_name(modules: dict[str, nn.Module], layer: str) -> str:
    """The qualified name of the block a scope for ``layer`` (a qualified name in ``modules``, the model's
    ``named_modules``) is opened in: its grandparent, which holds the layer's consumer where the MLP is two
    modules (BERT's intermediate and output); its parent where the grandparent is a container never called
    (a ``ModuleList`` or ``ModuleDict`` of MLPs)."""
    parts = layer.split(".")
    grandparent = ".".join(parts[:-2])
    if len(parts) >= 2 and isinstance(modules.get(grandparent), (nn.ModuleList, nn.ModuleDict)):
        return ".".join(parts[:-1])
    return grandparent


def outermost(model: nn.Module, names: Iterable[str]) -> list[nn.Module]:
    """The modules of ``model`` named (qualified names, "" the model), leaving out any inside another."""
    kept: list[str] = []
    for name in sorted(set(names), key=lambda n: n.count(".") if n else -1):
        if not any(k == "" or name == k or name.startswith(k + ".") for k in kept):
            kept.append(name)
    found = dict(model.named_modules(remove_duplicate=False))
    return list({id(found[n]): found[n] for n in kept}.values())


def owners(modules: Iterable[nn.Module]) -> list[Any]:
    """Let scopes be opened inside each of ``modules`` (:func:`open_scope`); the hooks' handles, to remove."""
    handles: list[Any] = []
    for module in modules:
        handles.append(module.register_forward_pre_hook(_running))
        handles.extend(closing([module]))
    return handles


def closing(modules: Iterable[nn.Module]) -> list[Any]:
    """Close, at the end of each of ``modules``' forward, what was opened inside it; the hooks' handles."""
    return [module.register_forward_hook(_leave, always_call=True) for module in modules]


class Hooked:
    """What a lever that substitutes saved tensors turned on: :attr:`modules`, the layers it hooked, and
    the hooks' handles; :meth:`remove` takes them off."""

    def __init__(self, modules: list[nn.Module], handles: list[Any]) -> None:
        self.modules = modules
        self._handles = handles

    @property
    def stood_aside(self) -> list[tuple[nn.Module, str]]:
        """The layers of :attr:`modules` where the lever stood aside for others' hooks, at least once since
        it was turned on, each with the hook it found."""
        return [(m, _ASIDE[m]) for m in self.modules if m in _ASIDE]

    @property
    def active(self) -> bool:
        """Whether the lever does anything on this torch (False where it cannot tell which hooks are in force)."""
        return bool(self.modules) and available()

    def remove(self) -> None:
        """Takes the hooks off, and closes what an interrupted forward left open on this thread."""
        for handle in self._handles:
            handle.remove()
        self._handles, self.modules = [], []
        _unwind(None)
