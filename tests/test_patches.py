"""Every patch the package applies is listed while it is in force (what, cause, scope) and undone by its
feature's own undo: the attribute is back exactly as it was, and the list no longer has it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

import amp_backends
from amp_backends import patches
from amp_backends.memory.chunked_loss import lazy_head, undo_lazy_head
from amp_backends.memory.compile_once import compile_once
from amp_backends.memory.recompute import RecomputeError, selective_recompute
from amp_backends.memory.recompute import unavailable_reason as recompute_unavailable
from amp_backends.memory.saves import low_precision_saves


def _listed() -> list[str]:
    return [p.what for p in patches.active()]


class Plain:
    def method(self) -> str:
        return "class"


# -- the primitive ----------------------------------------------------------------------------------


def test_replace_puts_back_the_class_attribute_or_the_own_one():
    obj = Plain()
    patch = patches.replace(obj, "method", lambda: "patched", cause="a test", scope="until remove()")
    assert obj.method() == "patched" and patch in patches.active() and patch.what == "Plain.method"
    assert (patch.cause, patch.scope) == ("a test", "until remove()")
    patch.remove()
    patch.remove()  # once
    assert "method" not in vars(obj) and obj.method() == "class" and patch not in patches.active()

    def own() -> str:
        return "own"

    obj.method = own
    with patches.replaced(obj, "method", lambda: "patched", cause="a test") as inner:
        assert obj.method() == "patched" and inner.active
    assert vars(obj)["method"] is own and not inner.active


def test_a_replacement_made_since_is_left_alone():
    obj = Plain()
    patch = patches.replace(obj, "method", lambda: "patched", cause="a test", scope="until remove()")

    def later() -> str:
        return "later"

    obj.method = later
    patch.remove()
    assert vars(obj)["method"] is later and patch not in patches.active()


def test_a_patch_keeps_nothing_alive_and_leaves_the_list_with_its_object():
    obj = Plain()
    ref = weakref.ref(obj)
    patches.replace(obj, "method", obj.method, cause="bound to the object itself", scope="until remove()")
    patch = patches.find(obj, "method")
    assert patch is not None and patch.active
    del obj
    gc.collect()
    assert ref() is None and not patch.active


def test_wrap_and_unwrap_follow_the_wrappers_previous():
    class Wrapper:
        def __init__(self, previous: object) -> None:
            self.previous = previous

        def __call__(self) -> str:
            return "wrapped"

    obj = Plain()
    first = Wrapper(None)
    patches.wrap(obj, "method", first, cause="first", scope="until unwrap()")
    second = Wrapper(first)
    patches.wrap(obj, "method", second, cause="second", scope="until unwrap()")
    assert patches.find(obj, "method") is patches.find(obj, "method", second)
    patches.unwrap(obj, "method", first)  # wrapped over: left in place, its record ended
    assert vars(obj)["method"] is second and patches.find(obj, "method", first) is None
    patches.unwrap(obj, "method", second)
    assert vars(obj)["method"] is first  # the previous one, as torch users stack wrappers
    first_untracked = vars(obj)["method"]
    patches.unwrap(obj, "method", first_untracked)  # no record left: undone the same way
    assert "method" not in vars(obj) and patches.find(obj, "method") is None


def test_stdout_to_stderr_is_listed_while_it_lasts():
    out, err = sys.stdout, sys.stderr
    with patches.stdout_to_stderr(cause="a test") as patch:
        assert sys.stdout is err and patch.what == "sys.stdout" and patch.active
    assert sys.stdout is out and not patch.active


# -- each feature's patch -----------------------------------------------------------------------------


def test_the_arenas_zero_grad_is_listed_until_release():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = amp_backends.flat_grads(opt)
    patch = patches.find(opt, "zero_grad")
    assert patch is not None and patch.what == "SGD.zero_grad" and opt.zero_grad == arena.zero_grad
    arena.release()
    assert "zero_grad" not in vars(opt) and not patch.active and patches.find(opt, "zero_grad") is None


def test_a_precision_policys_forwards_and_the_compile_flag_are_listed_until_remove():
    from torch._functorch import config

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    before = getattr(config, "backward_pass_autocast", None)  # torch 2.4's functorch has no such setting
    policy = amp_backends.precision_policy(model, fp32=[nn.LayerNorm])
    assert patches.find(model[1], "forward") is not None and "LayerNorm.forward" in _listed()
    if before == "same_as_forward":  # torch's default: switched while the policy's wrapper is held
        assert config.backward_pass_autocast == "off" and patches.find(config, "backward_pass_autocast") is not None
    policy.remove()
    gc.collect()
    assert "forward" not in vars(model[1]) and patches.find(model[1], "forward") is None
    assert getattr(config, "backward_pass_autocast", None) == before
    assert patches.find(config, "backward_pass_autocast") is None


def test_low_precision_saves_lazy_head_and_recompute_are_undone_by_their_remove():
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
    saves = low_precision_saves(model)
    assert patches.find(model[0], "forward") is not None
    saves.remove()
    assert "forward" not in vars(model[0]) and patches.find(model[0], "forward") is None

    head = nn.Linear(8, 16)
    lazy_head(head)
    assert patches.find(head, "forward") is not None
    undo_lazy_head(head)
    assert "forward" not in vars(head) and patches.find(head, "forward") is None

    blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
    if recompute_unavailable() is not None:  # torch 2.4: refused before any forward is wrapped
        with pytest.raises(RecomputeError):
            selective_recompute(nn.Sequential(*blocks), blocks=list(blocks))
        assert all(patches.find(b, "forward") is None for b in blocks)
        return
    handle = selective_recompute(nn.Sequential(*blocks), blocks=list(blocks))
    assert all(patches.find(b, "forward") is not None for b in blocks)
    handle.remove()
    assert all("forward" not in vars(b) and patches.find(b, "forward") is None for b in blocks)


def test_compile_once_patches_torch_compile_only_inside_the_step():
    real = torch.compile
    seen = []

    class Watching(torch.optim.SGD):
        def step(self, closure=None):  # the optimizer's step, where torchao's compiles
            seen.append((torch.compile is real, "torch.compile" in _listed()))
            return super().step(closure)

    model = nn.Linear(2, 2)
    opt = compile_once(Watching(model.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert seen == [(False, True)] and torch.compile is real and "torch.compile" not in _listed()


def test_nothing_is_patched_by_importing_the_package():
    code = ("import amp_backends, amp_backends.memory, amp_backends.precision, amp_backends.cli.bench_memory\n"
            "from amp_backends import patches\nprint(len(patches.active()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.stdout.strip() == "0", out.stderr


def test_a_plugin_loads_with_stdout_on_stderr_listed():
    from amp_backends.registry.registry import Registry

    seen = []

    class Plugin:
        @amp_backends.hookimpl
        def amp_backends_register_backends(self, register):
            seen.append((sys.stdout is sys.stderr, [p.what for p in patches.active()]))

    registry = Registry(group="amp_backends_test_none")  # no installed plugins: only this one
    registry.register_plugin(Plugin(), name="printing-plugin")
    out = sys.stdout
    assert "sys.stdout" not in _listed()  # other tests' models this process still holds may keep theirs listed
    registry.names()
    assert [(redirected, listed.count("sys.stdout")) for redirected, listed in seen] == [(True, 1)]
    assert sys.stdout is out and "sys.stdout" not in _listed()
