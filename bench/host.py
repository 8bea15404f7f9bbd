"""Host time per step of the scaler's gradient work: arena, per-tensor, and torch.amp.GradScaler.

    python bench/host.py                       # 200, 2000 and 10000 parameters
    python bench/host.py --params 2000 --json out.json
    python bench/host.py --params 500,2000,8000 --numel 4,1   # parameters of 4 elements, then of 1
    python bench/host.py --params 500,2000,8000 --numel 4,1 --alone   # the arena's unscale_ and check alone

For each size, four optimizers over identical parameters (small gradients of mixed sizes, so the
host work, not the arithmetic, is what is timed; ``--numel`` gives every parameter that many
elements instead, one-element parameters included): ours with ``amp_backends.flat_grads`` (arena,
``check="refcount"``, the default: constant work), the same with ``check="identity"`` (a look at
every parameter), ours without an arena (per-tensor), and ``torch.amp.GradScaler`` (the anchor). Two operations per step:
``unscale_`` alone, and unscale + clip (ours: ``scaler.clip_grad_norm_``; torch: ``unscale_`` then
``torch.nn.utils.clip_grad_norm_``). Each is timed with the host clock and no device sync (on a
GPU that is launch cost; on a CPU it includes the arithmetic), interleaved across the three, after
warm-up; medians over the repetitions, and ratios against torch's from the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

import amp_backends

KINDS = ("arena", "arena-identity", "per-tensor", "torch")
SIZES = (16, 64, 9, 128, 3, 37)  # elements per gradient, cycled: small, so that host work dominates


def _params(n: int, device: torch.device, numel: int | None = None, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = torch.rand(numel or SIZES[i % len(SIZES)], generator=g) + 0.5
        out.append(torch.nn.Parameter(t.to(device)))
    return out


def _setup(n: int, device: torch.device, kind: str,
           numel: int | None = None) -> tuple[Callable[[], object], Callable[[], object]]:
    params = _params(n, device, numel)
    opt = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = (torch.rand(p.shape, generator=g) + 0.5).to(device)
    if kind.startswith("arena"):
        amp_backends.flat_grads(opt, check="identity" if kind == "arena-identity" else "refcount")
    if kind == "torch":
        scaler: torch.amp.GradScaler = torch.amp.GradScaler(device.type, init_scale=1.0)
    else:
        scaler = amp_backends.GradScaler(device, init_scale=1.0)  # the backend's kernel: Triton on CUDA
    scaler.scale(torch.ones((), device=device))  # makes the scale; 1.0 leaves the gradients as they are

    def fresh() -> None:
        scaler._per_optimizer_states[id(opt)] = _refresh_per_optimizer_state()

    def unscale() -> object:
        fresh()
        return scaler.unscale_(opt)

    def clip() -> object:
        fresh()
        if kind == "torch":
            scaler.unscale_(opt)
            return torch.nn.utils.clip_grad_norm_(params, 1e9)
        return scaler.clip_grad_norm_(opt, 1e9)  # type: ignore[attr-defined]  # amp_backends' GradScaler has it; the name is torch's type

    return unscale, clip


def _time(fns: dict[str, Callable[[], object]], device: torch.device, reps: int) -> dict[str, float]:
    """Median host seconds per call, the variants interleaved call by call."""
    for fn in fns.values():  # warm-up: caches, Triton compilation, allocator
        for _ in range(5):
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
        if device.type == "cuda" and i % 10 == 9:
            torch.cuda.synchronize()  # keeps the launch queue short: host time, not queue back-pressure
    return {k: statistics.median(v) for k, v in samples.items()}


def _profile(n: int, device: torch.device) -> int:
    import cProfile
    import pstats

    for kind in ("arena", "arena-identity"):
        unscale, _ = _setup(n, device, kind)
        _time({kind: unscale}, device, 20)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            unscale()
        profile.disable()
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"# {kind}, {n} parameters, 200 calls")
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    return 0


def _alone(counts: list[int], numels: list[int | None], device: torch.device, reps: int) -> int:
    """The arena's ``unscale_`` and its check (``problem()``) timed by themselves, not interleaved with the
    other kinds (whose per-tensor work leaves the caches cold): median and best host us of ``reps`` calls."""
    from amp_backends.gradients.arena import flat_grads_of

    print(f"# arena alone (check='refcount'), {reps} calls each: median / best host us")
    print(f"{'params':>7} {'numel':>6} {'unscale_':>16} {'problem()':>16}")
    for numel in numels:
        for n in counts:
            params = _params(n, device, numel)
            opt = torch.optim.SGD(params, lr=0.1)
            for p in params:
                p.grad = torch.ones_like(p)
            arena = amp_backends.flat_grads(opt)
            scaler = amp_backends.GradScaler(device, init_scale=1.0)
            scaler.scale(torch.ones((), device=device))

            def step() -> None:
                scaler._per_optimizer_states[id(opt)] = _refresh_per_optimizer_state()
                scaler.unscale_(opt)

            figures = []
            for fn in (step, arena.problem):
                for _ in range(20):
                    fn()
                samples = []
                for _ in range(reps):
                    start = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - start)
                figures.append(f"{statistics.median(samples) * 1e6:.1f} / {min(samples) * 1e6:.1f}")
            assert flat_grads_of(opt) is arena
            print(f"{n:>7} {numel or 'mixed':>6} {figures[0]:>16} {figures[1]:>16}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="200,2000,10000", help="comma-separated parameter counts")
    parser.add_argument("--numel", default="mixed",
                        help="elements per parameter, comma-separated (e.g. 4,1); 'mixed': 16, 64, 9, 128, 3, 37 in turn")
    parser.add_argument("--ops", default="unscale_,clip_grad_norm_", help="which to time, comma-separated")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--alone", action="store_true",
                        help="instead: the arena's unscale_ and check timed by themselves (median and best)")
    parser.add_argument("--profile", type=int, metavar="N",
                        help="instead: where the arena's unscale_ spends its host time at N parameters (cProfile)")
    args = parser.parse_args(argv)
    if args.profile:
        return _profile(args.profile, torch.device(args.device))
    device = torch.device(args.device)
    counts = [int(x) for x in args.params.split(",")]
    kernel = amp_backends.get(device.type).kernel.name
    numels: list[int | None] = [None if x == "mixed" else int(x) for x in args.numel.split(",")]
    if args.alone:
        return _alone(counts, numels, device, args.reps)
    rows = []
    for numel in numels:
        for n in counts:
            ops = {kind: _setup(n, device, kind, numel) for kind in KINDS}
            for index, op in enumerate(("unscale_", "clip_grad_norm_")):
                if op not in args.ops.split(","):
                    continue
                t = _time({kind: fns[index] for kind, fns in ops.items()}, device, args.reps)
                rows.append({"params": n, "numel": numel or "mixed", "op": op,
                             **{f"{k}_us": v * 1e6 for k, v in t.items()},
                             **{f"torch/{k}": t["torch"] / t[k] for k in KINDS if k != "torch"}})
    header = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "kernel": kernel,
        "reps": args.reps,
    }
    print(f"# {header['device']} | torch {header['torch']} | our kernel: {kernel} | {header['date']} | "
          f"median host us per call, {args.reps} interleaved reps")
    print(f"{'params':>7} {'numel':>6} {'op':<16} " + " ".join(f"{k:>14}" for k in KINDS) + "   torch/"
          + " torch/".join(k for k in KINDS if k != "torch"))
    for r in rows:
        print(f"{r['params']:>7} {r['numel']:>6} {r['op']:<16} " + " ".join(f"{r[k + '_us']:>14.1f}" for k in KINDS)
              + "   "
              + " ".join(f"{r['torch/' + k]:>6.1f}x" for k in KINDS if k != "torch"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**header, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
