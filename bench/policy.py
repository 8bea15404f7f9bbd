"""What a precision policy costs a training step: the bench's GPT-2-small-shaped model with and
without ``amp_backends.precision_policy`` (the recipe: its LayerNorms and the LM head in float32),
and against the same placement written by hand.

    python bench/policy.py                     # bench CPU scale (small), bfloat16, 15 rounds
    python bench/policy.py --size full --dtype float16 --json out.json

One training step (forward under the backend's autocast, backward through its scaler, AdamW step)
of three copies of the same model, timed in interleaved rounds (the order rotating each round)
after warm-up, with a device sync around each step:

- ``none``: no policy;
- ``manual``: the same modules in float32 by hand (each forward wrapped in
  ``torch.autocast(device_type, enabled=False)`` with its input cast to float32), what a user
  writes without this package;
- ``policy``: ``precision_policy(model)``.

``policy / none`` is what the policy costs in all (its wrappers plus the float32 compute it asks
for: the head of a GPT-2 is its largest matmul); ``policy / manual`` is the cost of the policy's
machinery alone, the figure the goal (<= 1%) is about. Medians over rounds, with quartiles.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import sys
import time
import warnings

import torch

import amp_backends
from amp_backends.cli.bench import Mode, _quartiles, _ratios, make_step
from amp_backends.cli.bench_models import MODELS


def _timed(be, step) -> float:  # type: ignore[no-untyped-def]  # a timing helper
    be.synchronize()
    start = time.perf_counter()
    step()
    be.synchronize()
    return time.perf_counter() - start


def _ratio(a: list[float], b: list[float]) -> dict[str, object]:
    low, median, high = _quartiles(_ratios(a, b))
    return {"median": median, "iqr": [low, high]}


def _by_hand(module: torch.nn.Module, device_type: str) -> None:
    """The float32 placement without this package: autocast off, the input cast, nothing else."""
    forward = module.forward

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, enabled=False):
            return forward(x.float())

    module.forward = run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--model", default="gpt2-small", choices=sorted(MODELS))
    parser.add_argument("--size", default="small", choices=("small", "full"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
    be = amp_backends.get(args.backend)
    dtype = be.resolve_dtype(args.dtype)
    spec = MODELS[args.model]
    dev = be.device()
    torch.manual_seed(0)
    plain = spec.build(args.size).to(dev)
    policied = copy.deepcopy(plain)
    manual = copy.deepcopy(plain)
    policy = amp_backends.precision_policy(policied)
    for name in policy.selected:
        _by_hand(manual.get_submodule(name), be.device_type)
    inputs, targets = spec.batch(args.size, dev, None)
    mode = Mode(f"amp-{args.dtype}", "amp", dtype)
    steps = {name: make_step(be, model, torch.optim.AdamW(model.parameters(), lr=1e-4), spec.loss, (inputs, targets), mode)
             for name, model in (("none", plain), ("manual", manual), ("policy", policied))}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            times[name].append(_timed(be, steps[name]))
    result = {
        "date": datetime.date.today().isoformat(),
        "device": str(dev),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "backend": be.name,
        "model": args.model,
        "size": args.size,
        "dtype": str(dtype).replace("torch.", ""),
        "fp32_modules": len(policy.selected),
        "rounds": args.rounds,
        **{f"step_ms_{name}": 1e3 * statistics.median(times[name]) for name in names},
        "policy_vs_none": _ratio(times["policy"], times["none"]),
        "policy_vs_manual": _ratio(times["policy"], times["manual"]),
    }
    print(f"{args.model} ({args.size}), {be.name} {result['dtype']}, {len(policy.selected)} modules in float32, "
          f"{args.rounds} rounds: step {result['step_ms_none']:.1f} ms without a policy, "
          f"{result['step_ms_manual']:.1f} ms by hand, {result['step_ms_policy']:.1f} ms with the policy")
    for key in ("policy_vs_none", "policy_vs_manual"):
        med, (lo, hi) = result[key]["median"], result[key]["iqr"]
        print(f"  {key.replace('_vs_', ' / ')}: {med:.3f} [{lo:.3f}-{hi:.3f}]")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
