"""The bf16 stochastic-rounding step (torchao's ``_AdamW(bf16_stochastic_round=True)``) against AdamW on
float32 masters, on BERT-base's parameter shapes (201 parameters, 9 distinct shapes).

    python bench/sr_step.py            # a GPU: full size, under a minute with the compiles
    python bench/sr_step.py --smoke    # a CPU: each dimension / 16, a few steps, one thread

Rows, each the median of ``--steps`` optimizer steps after warm-up (gradients fixed, bf16 parameters):

- ``StochasticAdamW``: :class:`amp_backends.memory.StochasticAdamW`, the same update (bitwise, given the
  same random bits) in a few multi-tensor ops per chunk of elements, whatever the number of parameters;
- ``StochasticAdamW compiled``: the same with ``compile=True`` (each chunk's arithmetic one compiled
  function: one kernel on a GPU; two graphs at most);
- ``torchao-sr``: torchao's step as it is: one ``torch.compile(...)`` call per parameter per step;
- ``torchao-sr compile_once``: the same step with each compile wrapper built once
  (:func:`amp_backends.memory.compile_once.compile_once`), bitwise the same parameters;
- ``adamw-foreach masters``: ``torch.optim.AdamW(foreach=True)`` on float32 masters, then one
  multi-tensor copy into the bf16 parameters (the device work of the lean mode's master step);
- ``adamw-fused masters``: the same with ``fused=True``, where the device has it.

Also printed: the graphs dynamo compiled (torchao's update and the compiled ``StochasticAdamW``'s) and
how many times it recompiled (a recompile would be a shape falling off the cache), and the first step's
time (the compiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import amp_backends
from amp_backends.memory import StochasticAdamW
from amp_backends.memory.compile_once import compile_once


def bert_base_shapes() -> list[tuple[int, ...]]:
    """BertForSequenceClassification(BertConfig())'s parameter shapes, in order (2 labels)."""
    h, ff, layers = 768, 3072, 12
    shapes: list[tuple[int, ...]] = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(layers):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (ff, h), (ff,), (h, ff), (h,), (h,), (h,)]
    return shapes + [(h, h), (h,), (2, h), (2,)]


def _scaled(shapes: list[tuple[int, ...]], div: int) -> list[tuple[int, ...]]:
    return [tuple(max(1, d // div) for d in s) for s in shapes]


def _params(shapes: list[tuple[int, ...]], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device, dtype))
        p.grad = (torch.randn(s, generator=g) * 1e-3).to(device, dtype)
        out.append(p)
    return out


def steps(be: amp_backends.Backend, shapes: list[tuple[int, ...]], skip_torchao: bool = False) -> dict[str, Callable[[], None]]:
    """name -> one optimizer step of that kind over fresh parameters of ``shapes``."""
    device = be.device()
    made: dict[str, Callable[[], None]] = {}
    made["StochasticAdamW"] = StochasticAdamW(_params(shapes, device, torch.bfloat16), lr=1e-3).step
    made["StochasticAdamW compiled"] = StochasticAdamW(_params(shapes, device, torch.bfloat16), lr=1e-3, compile=True).step
    try:
        if skip_torchao:
            raise ImportError("--skip-torchao")
        from torchao.optim import _AdamW
    except Exception as exc:  # noqa: BLE001 - the reason is printed
        print(f"torchao's _AdamW not measured ({type(exc).__name__}: {exc})", file=sys.stderr)
    else:
        made["torchao-sr"] = _AdamW(_params(shapes, device, torch.bfloat16), lr=1e-3, bf16_stochastic_round=True).step
        once = compile_once(_AdamW(_params(shapes, device, torch.bfloat16), lr=1e-3, bf16_stochastic_round=True))
        made["torchao-sr compile_once"] = once.step
    fused_ok = device.type in ("cuda", "xpu", "mps", "cpu")
    for impl in ("foreach", "fused") if fused_ok else ("foreach",):
        low = [p.detach() for p in _params(shapes, device, torch.bfloat16)]
        masters = [p.float() for p in low]
        for m, p in zip(masters, low):
            m.grad = torch.randn_like(m) * 1e-3
        opt = torch.optim.AdamW(masters, lr=1e-3, **{impl: True})

        def step(opt: torch.optim.Optimizer = opt, low: list[torch.Tensor] = low,
                 masters: list[torch.Tensor] = masters) -> None:
            opt.step()
            with torch.no_grad():
                torch._foreach_copy_(low, masters)

        made[f"adamw-{impl} masters"] = step
    return made


def run(be: amp_backends.Backend, shapes: list[tuple[int, ...]], n: int, warmup: int,
        skip_torchao: bool = False) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    counters.clear()
    made = steps(be, shapes, skip_torchao)
    first: dict[str, float] = {}
    for name, step in made.items():
        be.synchronize()
        t = time.perf_counter()
        step()
        be.synchronize()
        first[name] = time.perf_counter() - t
        for _ in range(warmup - 1):
            step()
    compiled = dict(counters["stats"])
    times: dict[str, list[float]] = {name: [] for name in made}
    for _ in range(n):
        for name, step in made.items():  # interleaved: drift hits every row alike
            be.synchronize()
            t = time.perf_counter()
            step()
            be.synchronize()
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["adamw-foreach masters"])
    rows = [{"step": name, "ms": statistics.median(ts) * 1e3, "vs_foreach_masters": statistics.median(ts) / base,
             "first_step_s": first[name], "us_per_param": statistics.median(ts) * 1e6 / len(shapes)}
            for name, ts in times.items()]
    recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
    return {"params": len(shapes), "distinct_shapes": len(set(shapes)), "elements": sum(_numel(s) for s in shapes),
            "graphs_compiled": compiled.get("unique_graphs", 0), "recompiles": recompiles, "rows": rows}


def _numel(s: tuple[int, ...]) -> int:
    n = 1
    for d in s:
        n *= d
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--smoke", action="store_true", help="each dimension / 16, 5 steps (a CPU)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--skip-torchao", action="store_true", help="leave torchao's rows out (their compiles)")
    args = parser.parse_args()
    be = amp_backends.get(args.backend)
    if args.smoke:  # a shared CPU: OpenMP threads waiting on each other cost more than these small updates
        torch.set_num_threads(1)
    shapes = _scaled(bert_base_shapes(), 16) if args.smoke else bert_base_shapes()
    result = run(be, shapes, args.steps or (5 if args.smoke else 20), warmup=2 if args.smoke else 3,
                 skip_torchao=args.skip_torchao)
    result.update(backend=be.name, torch=torch.__version__, size="smoke (dims / 16)" if args.smoke else "full")
    try:
        import torchao

        result["torchao"] = torchao.__version__
    except Exception:  # noqa: BLE001
        result["torchao"] = None
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"backend {be.name}, torch {torch.__version__}, torchao {result['torchao']}, {result['size']}: BERT-base's "
          f"{result['params']} parameters, {result['distinct_shapes']} shapes, {result['elements']:,} elements")
    print(f"compiled updates (torchao's, StochasticAdamW's): {result['graphs_compiled']} graphs, "
          f"{result['recompiles']} recompiles")
    for r in result["rows"]:
        print(f"{r['step']:26} {r['ms']:9.2f} ms/step ({r['vs_foreach_masters']:5.2f}x foreach masters), "
              f"{r['us_per_param']:7.1f} us/param; first step {r['first_step_s']:.1f} s")


if __name__ == "__main__":
    main()
