"""A seeded differential fuzz of the training step: random AMP programs run with torch's scaler
(``torch.amp.GradScaler`` and torch's recipes, the oracle) and with this project's scaler, with and
without a gradient arena, and everything a user can observe compared at every point.

A program: a small model with a branch taken in some steps only (so parameters get gradients in
some steps only) and a parameter frozen at the start; SGD (momentum, weight decay) or Adam/AdamW,
for-loop, foreach or fused; gradient accumulation; every way of clearing gradients (the optimizer's
and the model's ``zero_grad`` with ``set_to_none`` both ways, ``p.grad = None`` by hand, no clearing);
``requires_grad_`` toggled; an inf injected into a gradient; clipping through the scaler or torch's
recipe (``unscale_`` + ``torch.nn.utils.clip_grad_norm_``); growth and backoff of the scale. And what
a hostile loop does (issue 38): ``torch.autograd.grad`` over every parameter before the backward (it
accumulates nothing into ``.grad``); a gradient's view kept for analysis while another gradient is
pruned by hand in the same step; model surgery (a parameter replaced in the module and in its
group's list); the optimizer made again over the same parameters; ``flat_grads`` called again.

Observed after every clearing and step: each parameter, each ``.grad`` (None or its values), the
optimizer's state, the norm a clip returned, the scale, the kept view, whether an optimizer made
again let the old one go, and any exception. Equal means bitwise, except NaN payloads and the sign
of zero.
"""

from __future__ import annotations

import math
import random
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

import amp_backends

#: What runs a program: torch's scaler (the oracle), or ours without an arena, or with one.
KINDS = ("torch", "ours", "ours-arena-refcount", "ours-arena-identity")
CLEARS = ("opt-none", "opt-zero", "model-none", "model-zero", "hand-none-all", "hand-none-some", "hand-zeros-some",
          "hand-clone-some", "keep")
#: Parameters a model surgery replaces (a new Parameter, equal in value, in the module and the optimizer's list).
SURGERIES = ("hidden.bias", "out.weight", "scale", "branch.bias")


@dataclass
class Program:
    seed: int
    optimizer: str
    impl: str
    momentum: float
    weight_decay: float
    width: int
    two_groups: bool
    frozen_until: int | None
    init_scale: float
    growth_interval: int
    steps: list[dict[str, Any]] = field(default_factory=list)

    def describe(self) -> str:
        return repr(asdict(self))


def make_program(seed: int) -> Program:
    """The program of ``seed`` (the same on every machine and run)."""
    r = random.Random(seed)
    optimizer = r.choice(["sgd", "sgd", "adam", "adamw"])
    impl = r.choice(["foreach", "fused", "loop"])
    program = Program(
        seed=seed,
        optimizer=optimizer,
        impl=impl,
        # torch's fused SGD with momentum raises when a parameter gets its first gradient after the others
        # did (and leaves uninitialised momentum after a skipped first step): tests/scaler/test_scaler.py has those
        momentum=r.choice([0.0, 0.9]) if optimizer == "sgd" and impl != "fused" else 0.0,
        weight_decay=r.choice([0.0, 0.01]),
        width=r.choice([5, 12, 13, 16]),
        two_groups=r.random() < 0.4,
        frozen_until=r.choice([None, None, 1, 2]),
        init_scale=2.0 ** r.randint(4, 16),
        growth_interval=r.randint(1, 3),
    )
    for _ in range(r.randint(3, 6)):
        program.steps.append({
            "clear": r.choice(CLEARS),
            "micro": [r.random() < 0.6 for _ in range(r.randint(1, 3))],  # the branch taken, per micro-batch
            "toggle": r.choice([None, None, None, "branch.weight", "out.bias"]),
            "inject": r.random() < 0.2,
            "clip": r.choice([None, None, "scaler", "recipe"]),
            "max_norm": r.choice([0.1, 1.0, 100.0]),
            "hold": r.random() < 0.3,  # the user keeps references to the gradients across the clearing
        })
    h = random.Random(f"hostile {seed}")  # drawn apart, so that the draws above (older programs) stay as they were
    for spec in program.steps:
        spec.update({
            "probe": h.random() < 0.15,  # torch.autograd.grad(...) over every parameter, the branch taken
            "prune": h.random() < 0.15,  # one gradient's view kept (detach), another replaced by hand (mask)
            "surgery": h.choice(SURGERIES) if h.random() < 0.12 else None,  # before the clearing
            "recreate": h.random() < 0.1,  # a new optimizer over the same parameters, flat_grads on it
            "rebuild": h.random() < 0.1,  # flat_grads(opt) again (what the warning after a surgery asks)
        })
    return program


class Net(nn.Module):
    """Odd sizes (a 13-wide layer's bias ends off a 16-byte boundary); ``branch`` and ``scale`` are
    used only when a step takes the branch; ``late`` starts frozen in some programs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.hidden = nn.Linear(width, width)
        self.branch = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.ones(width))
        self.late = nn.Linear(width, width, bias=False)
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, taken: bool) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.hidden(h))
        if taken:
            h = h + self.branch(h) * self.scale
        if self.late.weight.requires_grad:
            h = h + self.late(h)
        return self.out(h)


def _optimizer(program: Program, model: Net) -> torch.optim.Optimizer:
    named = dict(model.named_parameters())
    if program.two_groups:
        first = [named[k] for k in ("inp.weight", "inp.bias", "hidden.weight", "hidden.bias")]
        rest = [p for p in named.values() if all(p is not q for q in first)]
        params: Any = [{"params": first}, {"params": rest, "lr": 0.05}]
    else:
        params = list(named.values())
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}, "loop": {"foreach": False}}[program.impl]
    if program.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=program.momentum, weight_decay=program.weight_decay, **impl)
    cls = torch.optim.Adam if program.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=0.01, weight_decay=program.weight_decay, **impl)


def _snapshot(model: Net, opt: torch.optim.Optimizer, scaler: Any, where: str, extra: Any = None) -> dict[str, Any]:
    grads = {k: (None if p.grad is None else p.grad.detach().clone()) for k, p in model.named_parameters()}
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    state = {}
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        for key, value in opt.state.get(p, {}).items():
            state[f"{i}.{key}"] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    return {"where": where, "grads": grads, "params": params, "state": state, "scale": scale, "extra": extra}


def run(program: Program, kind: str, compile_backend: str | None = None) -> list[dict[str, Any]]:
    """Run ``program`` with ``kind`` (one of :data:`KINDS`) and return what was observed. With
    ``compile_backend``, the whole iteration (clearing, forward, backward, clip, step, update) is one
    function compiled with ``torch.compile(backend=compile_backend)``; else it runs eagerly, and what
    the clearing left is observed too."""
    torch.manual_seed(program.seed)
    model = Net(program.width)
    if program.frozen_until is not None:
        model.late.weight.requires_grad_(False)
    opt = _optimizer(program, model)
    if kind == "torch":
        scaler: Any = torch.amp.GradScaler("cpu", init_scale=program.init_scale, growth_interval=program.growth_interval)
    else:
        scaler = amp_backends.GradScaler("cpu", init_scale=program.init_scale, growth_interval=program.growth_interval)
        if kind.startswith("ours-arena"):
            amp_backends.flat_grads(opt, check=kind.rsplit("-", 1)[1])
    gen = torch.Generator().manual_seed(program.seed)
    named = dict(model.named_parameters())
    step = make_step(kind, named, clear=compile_backend is not None)
    if compile_backend is not None:
        torch._dynamo.reset()  # each run compiles afresh (else the cache of an earlier program's step is hit)
        step = torch.compile(step, backend=compile_backend)
    trace: list[dict[str, Any]] = []
    for n, spec in enumerate(program.steps):
        if program.frozen_until == n:
            model.late.weight.requires_grad_(True)
        if spec.get("surgery"):
            _surgery(spec["surgery"], model, opt, named)
        if spec.get("recreate"):
            gone = weakref.ref(opt)
            opt = _optimizer(program, model)  # the old one is dropped here: nothing else may hold it
            trace.append({"where": f"step {n} optimizer made again", "old optimizer freed": gone() is None})
        if kind.startswith("ours-arena") and (spec.get("recreate") or spec.get("rebuild")):
            amp_backends.flat_grads(opt, check=kind.rsplit("-", 1)[1])
        held = [p.grad for p in named.values()] if spec.get("hold") else []
        if compile_backend is None:
            _clear(spec["clear"], model, opt, named)
            trace.append(_snapshot(model, opt, scaler, f"step {n} after clear {spec['clear']}"))
        toggled = named[spec["toggle"]] if spec["toggle"] else None
        if toggled is not None and toggled.requires_grad:
            toggled.requires_grad_(False)
        else:
            toggled = None
        inputs = [torch.randn(6, 8, generator=gen) * 4 for _ in spec["micro"]]
        try:
            norm, kept = step(model, opt, scaler, inputs, spec)
        except Exception as exc:  # noqa: BLE001 - an exception is an observation
            trace.append({"where": f"step {n}", "raised": type(exc).__name__})
            return trace
        finally:
            if toggled is not None:
                toggled.requires_grad_(True)
        trace.append(_snapshot(model, opt, scaler, f"step {n} after step", norm))
        trace[-1]["held"] = {str(k): (None if g is None else g.clone()) for k, g in enumerate(held)}
        trace[-1]["kept"] = kept
        del held
    return trace


def _surgery(name: str, model: Net, opt: torch.optim.Optimizer, named: dict[str, torch.Tensor]) -> None:
    """Replace parameter ``name`` by a new one equal in value, in the module and in place in its group's
    list (the list and its length stay), its optimizer state carried over."""
    old = named[name]
    new = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, new)
    for group in opt.param_groups:
        params = group["params"]
        for j, p in enumerate(params):
            if p is old:
                params[j] = new
    if old in opt.state:
        opt.state[new] = opt.state.pop(old)
    named[name] = new


def make_step(kind: str, named: dict[str, torch.Tensor], clear: bool = False) -> Callable[..., Any]:
    """One iteration: (with ``clear``, the clearing first,) forward under fp16 autocast and scaled
    backward per micro-batch (after a ``torch.autograd.grad`` probe, on request), a gradient's view kept
    and another pruned on request, an inf injected on request, the clip, ``scaler.step`` and
    ``scaler.update``. Returns the norm the clip returned and the kept view's values after the step."""

    def step(model: Net, opt: torch.optim.Optimizer, scaler: Any, inputs: list[torch.Tensor], spec: dict[str, Any]):
        if clear:
            _clear(spec["clear"], model, opt, named)
        if spec.get("probe"):  # gradients for analysis: autograd.grad accumulates nothing into .grad
            with torch.autocast("cpu", dtype=torch.float16):
                probe = model(inputs[0], True).float().pow(2).mean()
            torch.autograd.grad(probe, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
        for x, taken in zip(inputs, spec["micro"]):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x, taken).float().pow(2).mean()
            scaler.scale(loss).backward()
        kept = None
        if spec.get("prune"):
            watched, pruned = named["hidden.weight"], named["inp.weight"]
            if watched.grad is not None:
                kept = watched.grad.detach()  # kept for analysis: it shares the gradient's memory
            if pruned.grad is not None:
                mask = (torch.arange(pruned.numel()) % 3 != 0).reshape(pruned.shape).to(pruned.dtype)
                pruned.grad = pruned.grad * mask
        if spec["inject"]:
            first = next((p for p in model.parameters() if p.grad is not None), None)
            if first is not None:
                first.grad.view(-1)[0] = math.inf
        norm = None
        if spec["clip"] == "scaler" and kind != "torch":
            norm = scaler.clip_grad_norm_(opt, spec["max_norm"])
        elif spec["clip"] == "scaler":  # what the scaler's clip is: torch's recipe over the optimizer's parameters
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], spec["max_norm"])
        elif spec["clip"] is not None:  # torch's recipe over the model's parameters, with either scaler
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_norm"])
        fused_sgd = isinstance(opt, torch.optim.SGD) and opt.defaults.get("fused")
        before = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                  for p, s in opt.state.items()} if kind == "torch" and fused_sgd else None
        scaler.step(opt)
        if before is not None and _torch_skipped(scaler, opt):
            # A skipped step leaves the optimizer's state as it was. torch's fused SGD with momentum
            # does not (its first step's momentum buffer is left uninitialised, torch 2.13): the oracle
            # is torch with that state put back.
            for p in list(opt.state):
                if p in before:
                    opt.state[p] = before[p]
                else:
                    del opt.state[p]
        scaler.update()
        return None if norm is None else norm.detach().clone(), None if kept is None else kept.clone()

    return step


def _torch_skipped(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer) -> bool:
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    return any(bool(t.item()) for t in found.values())


def _clear(how: str, model: Net, opt: torch.optim.Optimizer, named: dict[str, torch.Tensor]) -> None:
    if how == "opt-none":
        opt.zero_grad(set_to_none=True)
    elif how == "opt-zero":
        opt.zero_grad(set_to_none=False)
    elif how == "model-none":
        model.zero_grad(set_to_none=True)
    elif how == "model-zero":
        model.zero_grad(set_to_none=False)
    elif how == "hand-none-all":
        for p in model.parameters():
            p.grad = None
    elif how == "hand-none-some":
        for k in ("hidden.weight", "out.bias"):
            named[k].grad = None
    elif how == "hand-zeros-some":  # assigned: a tensor of the user's where there was a gradient, or None
        for k in ("hidden.bias", "branch.weight"):
            named[k].grad = torch.zeros_like(named[k])
    elif how == "hand-clone-some":
        for k in ("inp.weight", "scale"):
            if named[k].grad is not None:
                named[k].grad = named[k].grad.clone()


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of observations, NaN payloads and the sign of zero aside."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def first_difference(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> str | None:
    """Where two traces first differ (None: they agree everywhere)."""
    for r, g in zip(ref, got):
        if not same(r, g):
            keys = [k for k in r if not same(r.get(k), g.get(k))]
            detail = []
            for k in keys:
                if isinstance(r.get(k), dict) and isinstance(g.get(k), dict):
                    detail += [f"{k}.{n}" for n in set(r[k]) | set(g[k]) if not same(r[k].get(n), g[k].get(n))]
                else:
                    detail.append(f"{k}: {r.get(k)!r} vs {g.get(k)!r}")
            return f"at {r.get('where')}: {', '.join(detail)}"
    if len(ref) != len(got):
        return f"traces of different lengths: {len(ref)} vs {len(got)} ({ref[-1].get('raised')} vs {got[-1].get('raised')})"
    return None
