"""``amp-backends bench``: what AMP buys on this machine, FP32 against AMP, per model.

For each model (an MLP, a small CNN, a small transformer encoder) one training step is
timed in FP32 and under AMP in each supported dtype. Steps run interleaved (one round of
each configuration in turn) after warm-up, and medians are reported. Peak memory is the
device allocator's peak where the device has one; elsewhere (CPU) it is the memory of
the tensors autograd saves for backward, which is what lower precision shrinks.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .backend import Backend
from .errors import AmpBackendsError, PerformanceWarning
from .registry import get


class _Encoder(torch.nn.Module):
    def __init__(self, d: int, layers: int, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        layer = torch.nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, batch_first=True, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def models(scale: float) -> dict[str, tuple[Callable[[], torch.nn.Module], Callable[[torch.device], tuple[Any, Any]]]]:
    """name -> (model factory, batch factory); ``scale`` shrinks everything for quick runs."""
    w = max(8, int(1024 * scale))
    b = max(4, int(128 * scale))
    c = max(4, int(64 * scale))
    d = max(16, int(256 * scale) // 4 * 4)
    seq = max(8, int(128 * scale))

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(w, 4 * w), torch.nn.GELU(), torch.nn.Linear(4 * w, w), torch.nn.GELU(), torch.nn.Linear(w, 10))

    def cnn() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, c, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(c, 2 * c, 3, padding=1), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Conv2d(2 * c, 2 * c, 3, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(2 * c, 10),
        )

    return {
        "mlp": (mlp, lambda dev: (torch.randn(b, w, device=dev), torch.randint(0, 10, (b,), device=dev))),
        "cnn": (cnn, lambda dev: (torch.randn(b // 2, 3, 32, 32, device=dev), torch.randint(0, 10, (b // 2,), device=dev))),
        "transformer": (
            lambda: _Encoder(d, 2),
            lambda dev: (torch.randint(0, 1000, (b // 8, seq), device=dev), torch.randint(0, 1000, (b // 8, seq), device=dev)),
        ),
    }


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))


def make_step(be: Backend, factory: Callable[[], torch.nn.Module], batch: tuple[Any, Any], dtype: torch.dtype | None) -> Callable[[], None]:
    torch.manual_seed(0)
    model = factory().to(be.device())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = be.grad_scaler(dtype or be.default_dtype, enabled=dtype is not None)
    x, y = batch

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with be.autocast(dtype, enabled=dtype is not None):
            loss = _loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def peak_memory(be: Backend, step: Callable[[], None]) -> tuple[int, str]:
    """Peak bytes of one step: the allocator's peak, or bytes saved for backward."""
    be.synchronize()
    be.reset_peak_memory_stats()
    if be.max_memory_allocated() is not None:
        step()
        be.synchronize()
        return int(be.max_memory_allocated() or 0), "allocator peak"
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return saved, "saved activations"


def run(backend: str | None, rounds: int, warmup: int, scale: float) -> dict[str, Any]:
    be = get(backend)
    dtypes: list[torch.dtype | None] = [None] + [d for d in (torch.float16, torch.bfloat16) if d in be.supported_dtypes()]
    rows = []
    for name, (factory, batch_fn) in models(scale).items():
        batch = batch_fn(be.device())
        steps = {d: make_step(be, factory, batch, d) for d in dtypes}
        memory = {d: peak_memory(be, s) for d, s in steps.items()}
        for s in steps.values():
            for _ in range(warmup):
                s()
        times: dict[torch.dtype | None, list[float]] = {d: [] for d in dtypes}
        for r in range(rounds):
            order = dtypes if r % 2 == 0 else dtypes[::-1]
            for d in order:
                be.synchronize()
                t0 = time.perf_counter()
                steps[d]()
                be.synchronize()
                times[d].append(time.perf_counter() - t0)
        fp32 = statistics.median(times[None])
        for d in dtypes[1:]:
            amp = statistics.median(times[d])
            rows.append({
                "model": name,
                "dtype": str(d).replace("torch.", ""),
                "fp32_ms": fp32 * 1e3,
                "amp_ms": amp * 1e3,
                "speedup": fp32 / amp,
                "fp32_mem_mb": memory[None][0] / 2**20,
                "amp_mem_mb": memory[d][0] / 2**20,
                "mem_saving_pct": 100 * (1 - memory[d][0] / memory[None][0]) if memory[None][0] else 0.0,
                "memory_kind": memory[d][1],
                "native": d in be.native_dtypes(),
            })
    device_name = torch.cuda.get_device_name() if be.device_type == "cuda" else f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    return {
        "backend": be.name,
        "device": device_name,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "rounds": rounds,
        "rows": rows,
        "recommendations": recommend(rows),
    }


def recommend(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model: the fastest way to train it here (float32 or an AMP dtype), and the memory each AMP dtype saves."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        best = max(mine, key=lambda r: r["speedup"])
        fastest = best["dtype"] if best["speedup"] > 1.0 else "float32"
        out.append({
            "model": model,
            "fastest": fastest,
            "speedup": best["speedup"] if fastest != "float32" else 1.0,
            "mem_saving_pct": {r["dtype"]: r["mem_saving_pct"] for r in mine},
        })
    return out


def render(result: dict[str, Any]) -> str:
    from .console import render_table

    rows = [
        [r["model"], r["dtype"], "yes" if r["native"] else "no", f"{r['fp32_ms']:.2f}", f"{r['amp_ms']:.2f}",
         f"{r['speedup']:.2f}x", f"{r['mem_saving_pct']:.1f}%"]
        for r in result["rows"]
    ]
    table = render_table(["model", "AMP dtype", "native", "FP32 step ms", "AMP step ms", "speedup", "peak-mem saving"],
                         rows, markdown=True, right=(3, 4, 5, 6))
    advice = []
    for rec in result["recommendations"]:
        savings = ", ".join(f"{d} saves {p:.0f}%" for d, p in rec["mem_saving_pct"].items())
        if rec["fastest"] == "float32":
            advice.append(f"  {rec['model']}: float32 is fastest here (AMP is slower on this device); memory: {savings}")
        else:
            advice.append(f"  {rec['model']}: {rec['fastest']} ({rec['speedup']:.2f}x faster than float32); memory: {savings}")
    return "\n".join([
        f"amp-backends bench: backend {result['backend']} on {result['device']}, torch {result['torch']}, {result['date']}",
        f"medians of {result['rounds']} interleaved steps after warm-up; memory: {result['rows'][0]['memory_kind'] if result['rows'] else '-'}",
        "",
        table,
        "",
        "Recommendation (fastest here, per model):",
        *advice,
    ])


def plot(result: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AmpBackendsError("--plot needs matplotlib: pip install 'amp-backends[plot]'") from None
    rows = result["rows"]
    labels = [f"{r['model']}\n{r['dtype']}" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(labels, [r["speedup"] for r in rows], color="tab:blue")
    ax1.axhline(1.0, color="gray", lw=1)
    ax1.set_title("AMP speedup over FP32 (step time)")
    ax2.bar(labels, [r["mem_saving_pct"] for r in rows], color="tab:green")
    ax2.set_title(f"peak-memory saving, % ({rows[0]['memory_kind'] if rows else ''})")
    fig.suptitle(f"{result['backend']} on {result['device']}, torch {result['torch']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(backend: str | None, rounds: int, warmup: int, scale: float, as_json: bool, plot_path: str | None) -> int:
    """Run and print the bench (the CLI has checked the arguments)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)  # the table says which dtypes are native
        result = run(backend, rounds, warmup, scale)
    if plot_path:
        plot(result, plot_path)
    print(json.dumps(result, indent=2) if as_json else render(result))
    return 0
