"""A seeded differential fuzz of the lean mode's float32 masters: random programs train a small model
with ``memory_lean(weights=bfloat16|float16)`` and, beside it, plain torch does the same by hand
(float32 copies of the parameters, the same optimizer class and implementation, fed the low-precision
gradients upcast and unscaled in float32; every write the program makes to the model made to the
copy: each element the write changed as its float32 value, the others left as they were).
Interleaved with the steps: gradient accumulation, an inf in a float16 gradient, ``scaler.unscale_``
with ``scaler.clip_grad_norm_``, ``model.load_state_dict`` of a float32 checkpoint, an in-place edit
under ``no_grad``, ``nn.init`` on a weight, another optimizer stepping one weight, a checkpoint round
trip of the optimizer. After every step each master must equal its copy bitwise and each parameter the
copy rounded.
"""

from __future__ import annotations

import io
import random
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amp_backends
from amp_backends.memory.lean import memory_lean

OPS = ("step", "accumulate", "inf", "clip", "load", "clamp", "init", "other", "reload_opt")


def follow(copy: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> None:
    """A write to a low-precision parameter, made to its float32 copy: each element the write changed
    takes the parameter's new value; one it left as it was keeps the copy's float32 value, as a float32
    weight keeps its bits under an op that leaves it be."""
    with torch.no_grad():
        copy.copy_(torch.where(after == before, copy, after.float()))


def make_program(seed: int) -> dict[str, Any]:
    r = random.Random(seed)
    weights = r.choice(["bfloat16", "float16"])
    program = {
        "seed": seed, "weights": weights,
        "optimizer": r.choice(["sgd", "adam", "adamw"]), "impl": r.choice(["foreach", "fused", "loop"]),
        "width": r.choice([4, 9, 16]), "lr": r.choice([1e-2, 1e-3]), "weight_decay": r.choice([0.0, 0.1]),
        "ops": [],
    }
    program["momentum"] = r.choice([0.0, 0.9]) if program["optimizer"] == "sgd" and program["impl"] != "fused" else 0.0
    for _ in range(r.randint(4, 8)):
        op = r.choice(OPS)
        if weights == "bfloat16" and op in ("inf", "clip"):
            op = "step"  # no loss scale in bfloat16
        program["ops"].append(op)
    return program


def _model(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, width), nn.GELU(), nn.LayerNorm(width), nn.Linear(width, 3))


def _optimizer(program: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}, "loop": {"foreach": False}}[program["impl"]]
    kind = program["optimizer"]
    args: dict[str, Any] = {"lr": program["lr"], "weight_decay": program["weight_decay"], **impl}
    if kind == "sgd":
        return torch.optim.SGD(params, momentum=program["momentum"], **args)
    return (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(params, **args)


def _round_trip(state: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def run(program: dict[str, Any]) -> str | None:
    """Runs ``program``; returns the first difference from plain torch by hand, or None."""
    seed, dtype = program["seed"], getattr(torch, program["weights"])
    model = _model(program["width"], seed)
    try:
        _optimizer(program, [nn.Parameter(torch.zeros(1))])
    except (RuntimeError, TypeError, ValueError):  # no such implementation on this torch: foreach instead
        program = {**program, "impl": "foreach"}
    lean = memory_lean(model, _optimizer(program, model.parameters()), backend="cpu", weights=dtype)
    params = list(model.parameters())
    masters = lean.masters
    ref = [masters.get(p, p).detach().clone().float().requires_grad_(True) for p in params]
    ref_opt = _optimizer(program, ref)
    fused = program["impl"] == "fused"
    scaler = amp_backends.get("cpu").grad_scaler("float16", init_scale=2.0 ** 10) if dtype == torch.float16 else None
    other = torch.optim.SGD([params[0]], lr=0.05)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)

    def backward(poison: bool = False) -> None:
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x).float(), y) * (float("inf") if poison else 1.0)
        (scaler.scale(loss) if scaler is not None else loss).backward()

    for i, op in enumerate(program["ops"]):
        lean.optimizer.zero_grad()
        ref_opt.zero_grad()
        if op in ("load", "clamp", "init", "other", "reload_opt"):
            with torch.no_grad():
                if op == "load":
                    ckpt = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in lean.state_dict().items()}
                    model.load_state_dict(ckpt)
                    for (name, _), r in zip(model.named_parameters(), ref):
                        r.copy_(ckpt[name])
                elif op == "clamp":
                    before = params[-2].clone()
                    params[-2].clamp_(-0.1, 0.1)
                    follow(ref[-2], before, params[-2])
                elif op == "init":  # as nn.init.normal_ does: in place, under no_grad
                    before = params[2].clone()
                    params[2].normal_(0.0, 0.5, generator=g)
                    follow(ref[2], before, params[2])
            if op == "other":  # another optimizer steps the first weight (in its low precision)
                params[0].grad = torch.full_like(params[0], 0.01)
                before = params[0].detach().clone()
                other.step()
                with torch.no_grad():
                    follow(ref[0], before, params[0])
                lean.optimizer.zero_grad()
            if op == "reload_opt":
                lean.optimizer.load_state_dict(_round_trip(lean.optimizer.state_dict()))
            continue
        scale = None if scaler is None else torch.full((), scaler.get_scale())
        backward(poison=op == "inf")
        if op == "accumulate":
            backward()
        grads = [None if p.grad is None else p.grad.detach().float().clone() for p in params]
        found = torch.tensor(float(any(gr is not None and not torch.isfinite(gr).all() for gr in grads)))
        if scaler is None:
            lean.optimizer.step()
            for r, gr in zip(ref, grads):
                r.grad = gr
            ref_opt.step()
        else:
            inv = scale.double().reciprocal().float()
            if op == "clip":
                scaler.unscale_(lean.optimizer)
                scaler.clip_grad_norm_(lean.optimizer, 0.05)
            scaler.step(lean.optimizer)
            scaler.update()
            if op == "clip" or not fused:
                for r, gr in zip(ref, grads):
                    r.grad = None if gr is None else gr * inv
                if op == "clip":
                    torch.nn.utils.clip_grad_norm_([r for r in ref if r.grad is not None], 0.05)
            else:
                for r, gr in zip(ref, grads):
                    r.grad = gr
            if fused:
                ref_opt.grad_scale = None if op == "clip" else scale  # torch's fused protocol by hand
                ref_opt.found_inf = found
                ref_opt.step()
                del ref_opt.grad_scale, ref_opt.found_inf
            elif not found:
                ref_opt.step()
        masters = lean.masters
        for n, (p, r) in enumerate(zip(params, ref)):
            m = masters.get(p, p)
            if not torch.equal(m.float(), r):
                return f"op {i} ({op}): parameter {n}'s master differs by {float((m.float() - r).abs().max()):.3g}"
            if not torch.equal(p, r.to(p.dtype)):
                return f"op {i} ({op}): parameter {n} is not its master rounded"
    return None


def run_quietly(program: dict[str, Any]) -> str | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run(program)
