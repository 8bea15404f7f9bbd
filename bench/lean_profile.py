"""Where a lean step's time goes, against plain AMP's: torch's profiler over a few steps of a bench model.

    python bench/lean_profile.py                          # hf-bert and hf-gpt2 at full size on the GPU
    python bench/lean_profile.py --models hf-bert --modes amp-bfloat16,lean-bf16 --top 20
    python bench/lean_profile.py --levers --models hf-bert   # each lever of memory_lean alone, all, all but one
    python bench/lean_profile.py --host                   # the hooked levers' host cost where Python bounds the step
    python bench/lean_profile.py --smoke                  # mlp, small, on a CPU

For each model and mode: the step's time (median of the profiled steps, device events where the device
has them), the host time the step spends in Python and dispatch, the device's busy time (the sum of its
kernels' own times: well under the step's time, the step waits on the host), the ops that take the most
device (else host) time and those that take the most host time of their own, so a lean lever or a
scaler that costs more than it should shows which op it is (``AMP_BACKENDS_KERNEL=torch`` runs the
scaler's gradient op on torch's kernel, for comparison).

``--host``: the levers that run Python hooks (``activation_outputs``, ``shared_casts``, ``dropout_masks``),
each alone and the two defaults together, on Transformers' BERT structure at width 16 (12 layers, 2 x 8
tokens, bf16 autocast, float32 weights, one thread on a CPU): a step Python bounds, the worst case for
them. Forward and backward timed apart, every variant interleaved in each round; the sum of the two
medians per step, its excess over the run without them, and the Python calls a step (frames entered
and builtins called, counted by the interpreter's profiler: the same on any machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "plugins", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402  # after the checkout is on the path

from amp_backends import get  # noqa: E402
from amp_backends.cli.bench import make_step, modes_for  # noqa: E402
from amp_backends.cli.bench_memory import LEAN_HEADS  # noqa: E402
from amp_backends.cli.bench_models import MODELS  # noqa: E402


def profile(name: str, mode_name: str, size: str, steps: int, top: int) -> dict[str, Any]:
    be = get()
    spec = MODELS[name]
    mode = next(m for m in modes_for(be) if m.name == mode_name)
    torch.manual_seed(0)
    model = spec.build(size).to(be.device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = spec.batch(size, be.device(), None)
    step = make_step(be, model, opt, spec.loss_of, data, mode, LEAN_HEADS.get(name))
    for _ in range(3):
        step()
    be.synchronize()
    cuda = be.device_type == "cuda"
    times, host = [], []
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            step()
            host.append((time.perf_counter() - start) * 1e3)
            if cuda:
                end.record()
                torch.cuda.synchronize()
                times.append(begin.elapsed_time(end))
            else:
                times.append(host[-1])
    key = "device_time_total" if cuda else "cpu_time_total"
    events = prof.key_averages()
    if cuda and not hasattr(events[0], key):
        key = "cuda_time_total"
    ops = sorted(events, key=lambda e: getattr(e, key, 0.0), reverse=True)[:top]
    rows = [{"op": e.key, "calls": e.count // steps, "ms_per_step": getattr(e, key, 0.0) / 1e3 / steps} for e in ops]
    # the host's side: each op's own CPU time (a host sync's wait lands on the op that waits)
    by_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    host_rows = [{"op": e.key, "calls": e.count // steps, "ms_per_step": e.self_cpu_time_total / 1e3 / steps}
                 for e in by_host]
    self_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    busy = sum(getattr(e, self_key, 0.0) for e in events) / 1e3 / steps if cuda else None
    del model, opt, step
    be.synchronize()
    return {"model": name, "mode": mode_name, "step_ms": statistics.median(times),
            "host_ms": statistics.median(host), "device_busy_ms": busy, "by": key, "top": rows,
            "host_top": host_rows, "ops_per_step": sum(e.count for e in events) // steps}


#: memory_lean's switches that are on by default, all off: each lever below is timed alone
_OFF = {"saves": False, "activations": False, "activation_outputs": False, "shared_casts": False}
LEVERS: dict[str, dict[str, Any]] = {
    "amp": {}, "saves": {**_OFF, "saves": True}, "activations": {**_OFF, "activations": True},
    "activation_outputs": {**_OFF, "activation_outputs": True}, "shared_casts": {**_OFF, "shared_casts": True},
    "activation_inputs": {**_OFF, "activation_inputs": True}, "dropout_masks": {**_OFF, "dropout_masks": True},
    "weights": {**_OFF, "weights": torch.bfloat16}, "head": {**_OFF, "lm_head": True},
    "recompute": {**_OFF, "recompute": True},
    "all": {"weights": torch.bfloat16, "lm_head": True},  # the defaults on, as `lean-bf16` runs
    "all+max": {"weights": torch.bfloat16, "lm_head": True, "activation_inputs": True,
                "dropout_masks": True},  # as `lean-bf16-max` runs
}
#: ``all`` with one of its levers off, each: where the levers' costs do not add up (on the H200 each
#: default lever alone came to 0.99x plain AMP's step together, ``all`` to 1.15x), the lever whose
#: removal takes the most off ``all`` is the one that costs in combination
LEVERS.update({f"all-no-{lever}": {**LEVERS["all"], **off} for lever, off in (
    ("weights", {"weights": None}), ("saves", {"saves": False}), ("activations", {"activations": False}),
    ("activation_outputs", {"activation_outputs": False}), ("shared_casts", {"shared_casts": False}))})


#: memory_lean's hooked levers for ``--host``: each alone, and the two that are on by default together
HOST_LEVERS: dict[str, dict[str, bool]] = {
    "none": {}, "activation_outputs": {"activation_outputs": True}, "shared_casts": {"shared_casts": True},
    "dropout_masks": {"dropout_masks": True}, "defaults": {"activation_outputs": True, "shared_casts": True},
}


def _python_calls(fn: Any) -> int:
    """Python frames entered and builtins called by ``fn()``, counted with the collector off."""
    import gc

    count = [0]

    def tally(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    gc.collect()
    gc.disable()
    sys.setprofile(tally)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return count[0]


def host(steps: int) -> dict[str, dict[str, float]]:
    """The hooked levers' host cost (see the module docstring): per variant, the forward's and the
    backward's median ms, their sum's excess over ``none``, and the Python calls a step."""
    import transformers

    from amp_backends.memory.lean import memory_lean

    be = get()
    if be.device_type == "cpu":
        torch.set_num_threads(1)
    device = be.device()
    config = transformers.BertConfig(num_hidden_layers=12, hidden_size=16, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=64, max_position_embeddings=32)
    x, y = torch.randint(0, 64, (2, 8), device=device), torch.tensor([0, 1], device=device)
    runs = {}
    for name, on in HOST_LEVERS.items():
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(config).to(device).train()
        if on:
            memory_lean(model, None, backend=be, **{**_OFF, **on})
        runs[name] = model

    def forward(model: Any) -> Any:
        with be.autocast(torch.bfloat16):
            return model(x, labels=y).loss

    fwd: dict[str, list[float]] = {k: [] for k in runs}
    bwd: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(steps + 5):
        for name, model in runs.items():
            be.synchronize()
            start = time.perf_counter()
            loss = forward(model)
            be.synchronize()
            middle = time.perf_counter()
            loss.backward()
            be.synchronize()
            if i >= 5:
                fwd[name].append((middle - start) * 1e3)
                bwd[name].append((time.perf_counter() - middle) * 1e3)
    out = {}
    for name, model in runs.items():
        calls = _python_calls(lambda model=model: forward(model).backward())
        out[name] = {"forward_ms": statistics.median(fwd[name]), "backward_ms": statistics.median(bwd[name]),
                     "python_calls": calls}
        out[name]["step_ms"] = out[name]["forward_ms"] + out[name]["backward_ms"]
    for row in out.values():
        row["excess_ms"] = row["step_ms"] - out["none"]["step_ms"]
    return out


def levers(name: str, size: str, steps: int) -> dict[str, float]:
    """The bf16 step of bench model ``name`` with each lever of memory_lean alone (and all of them),
    each in a model and optimizer of its own, interleaved over ``steps`` rounds: median ms per step."""
    from amp_backends.memory.lean import memory_lean
    from amp_backends.memory.recompute import find_blocks

    be = get()
    spec = MODELS[name]
    data = spec.batch(size, be.device(), None)
    runs = {}
    for lever, kwargs in LEVERS.items():
        torch.manual_seed(0)
        model = spec.build(size).to(be.device())
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-5)
        if kwargs:
            kwargs = dict(kwargs)
            if kwargs.pop("lm_head", False):
                if LEAN_HEADS.get(name) is None and lever == "head":
                    continue
                kwargs["lm_head"] = LEAN_HEADS.get(name)
            if kwargs.get("recompute") and not find_blocks(model):
                continue
            low = kwargs.get("weights") is not None
            opt = memory_lean(model, opt if low else None, backend=be, **kwargs).optimizer or opt
        runs[lever] = (model, opt)
    x, y = data
    timings: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(steps + 2):
        for lever, (model, opt) in runs.items():
            be.synchronize()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with be.autocast(torch.bfloat16):
                loss = spec.loss_of(model, x, y)
            loss.backward()
            opt.step()
            be.synchronize()
            if i >= 2:
                timings[lever].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in timings.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="hf-bert,hf-gpt2")
    parser.add_argument("--modes", default="amp-bfloat16,lean-bf16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--levers", action="store_true", help="each lever alone, timed (no profiler)")
    parser.add_argument("--host", action="store_true", help="the hooked levers' host cost (BERT at width 16)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.host:
        rows = host(5 if args.smoke else max(args.steps, 50))
        none = rows["none"]
        for name, row in rows.items():
            print(f"{name:20s} step {row['step_ms']:6.2f} ms (forward {row['forward_ms']:.2f}, backward "
                  f"{row['backward_ms']:.2f}), {row['excess_ms']:+.2f} ms, {row['python_calls']} Python calls "
                  f"({row['python_calls'] - none['python_calls']:+d})")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    models = ["mlp"] if args.smoke else args.models.split(",")
    size = "small" if args.smoke or get().device_type == "cpu" else "full"
    out: list[dict[str, Any]] = []
    if args.levers:
        for name in models:
            ms = levers(name, size, 3 if args.smoke else args.steps)
            out.append({"model": name, "levers_ms": ms})
            print(f"{name}: " + ", ".join(f"{k} {v:.1f} ms ({v / ms['amp']:.2f}x)" for k, v in ms.items()))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0
    for name in models:
        for mode in args.modes.split(","):
            r = profile(name, mode, size, 2 if args.smoke else args.steps, args.top)
            out.append(r)
            busy = "" if r["device_busy_ms"] is None else f", device busy {r['device_busy_ms']:.1f} ms"
            print(f"\n{name} {mode}: step {r['step_ms']:.1f} ms, host {r['host_ms']:.1f} ms{busy}, "
                  f"{r['ops_per_step']} profiled events a step ({r['by']})")
            for row in r["top"]:
                print(f"  {row['ms_per_step']:8.2f} ms  {row['calls']:5d}x  {row['op'][:90]}")
            print("  host, each op's own CPU time:")
            for row in r["host_top"]:
                print(f"  {row['ms_per_step']:8.2f} ms  {row['calls']:5d}x  {row['op'][:90]}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
