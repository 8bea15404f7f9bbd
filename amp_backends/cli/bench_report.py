"""How ``amp-backends bench`` shows its result: the table and the recommendation, the model list,
and the plot."""

from __future__ import annotations

from typing import Any

from ..console import render_table
from ..errors import AmpBackendsError
from .bench_models import MODELS, format_params, param_count

__all__ = ["list_models", "plot", "render"]


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _versus(r: dict[str, Any]) -> str:
    """The row's cost against its reference: torch.amp's step (with the interquartile range of the
    per-round ratios), torchao's, or plain AMP's for the lean modes; fp8's speed against bf16."""
    for key in ("overhead_vs_torch", "overhead_vs_torchao"):
        if r.get(key) is not None:
            low, high = r.get(f"{key}_iqr", (r[key], r[key]))
            return f"{r[key]:.3f} [{low:.3f}-{high:.3f}]"
    if r.get("vs_amp") is not None:
        return f"{r['vs_amp']:.3f}"
    if r.get("speedup_vs_bf16") is not None:
        low, high = r["speedup_vs_bf16_iqr"]
        return f"bf16/fp8 {r['speedup_vs_bf16']:.2f}x [{low:.2f}-{high:.2f}]"
    return ""


def _resolution(result: dict[str, Any]) -> str:
    """Whether the rounds resolved 2% in the overhead ratios (their widest interquartile range)."""
    widths = [n["overhead_iqr_width"] for n in result["models"].values() if n.get("overhead_iqr_width") is not None]
    if not widths:
        return ""
    widest = max(widths)
    return f" (widest interquartile range {widest:.3f}: {'resolves' if widest <= 0.02 else 'does not resolve'} 2%)"


def render(result: dict[str, Any]) -> str:
    table_rows = []
    for r in result["rows"]:
        if r["step_ms"] is None:
            table_rows.append([r["model"], r["mode"], "-", "n/a", "", "", "", "", "", r.get("unavailable") or ""])
            continue
        low, high = r["speedup_vs_fp32_iqr"]
        overhead = _versus(r)
        native = "yes" if r["native"] else f"no ({r['rounds']} rounds)"
        table_rows.append([
            r["model"], r["mode"], native, f"{r['step_ms']:.1f}",
            f"{r['speedup_vs_fp32']:.2f}x [{low:.2f}-{high:.2f}]", f"{r['speedup_vs_best_full_precision']:.2f}x",
            _mib(r["peak_mem_bytes"]), f"{r['mem_saving_pct']:.0f}%" if r["mode"] != "fp32" else "",
            overhead, r["verdict"],
        ])
    table = render_table(
        ["model", "mode", "native", "step ms", "vs fp32 [IQR]", "vs best full", "peak MiB", "saving",
         "vs torch [IQR] / torchao / amp", "verdict"],
        table_rows, markdown=True, right=(3, 4, 5, 6, 7, 8))
    sizes = ", ".join(f"{m} batch {n['batch']} x {n['input']}" for m, n in result["models"].items())
    advice = []
    for rec in result["recommendation"]:
        memory = ", ".join(f"{k} {_mib(v)} MiB" for k, v in rec["peak_mem_bytes"].items())
        if rec["clear"]:
            speed = "" if rec["fastest"] == "fp32" else f" ({rec['speedup_vs_fp32']:.2f}x fp32's speed)"
            head = f"{rec['fastest']}{speed}: {rec['why']}"
        else:
            head = f"no clear winner (fastest median: {rec['fastest']}): {rec['why']}"
        advice.append(f"  {rec['model']}: {head}; peak memory: {memory}")
        if rec.get("fp8"):
            fp8 = rec["fp8"]
            advice.append(f"    fp8 (amp-fp8) {fp8['speedup_vs_bf16']:.2f}x bf16's speed "
                          f"[{fp8['iqr'][0]:.2f}-{fp8['iqr'][1]:.2f}]: {fp8['verdict']}")
    kind = result.get("memory") or next((r["memory_kind"] for r in result["rows"] if r.get("memory_kind")), "-")
    steps = ", ".join(f"{m} {n['steps_per_round']}" for m, n in result["models"].items() if "steps_per_round" in n)
    overheads = [f"{r['model']} {r['mode']} {r['overhead_vs_torch']:.3f} [{r['overhead_vs_torch_iqr'][0]:.3f}-"
                 f"{r['overhead_vs_torch_iqr'][1]:.3f}]" for r in result["rows"] if r.get("overhead_vs_torch") is not None]
    size_note = ("small size for a CPU (same architectures, narrower; --size full for the real ones)"
                 if result["size"] == "small" else "full size")
    return "\n".join([
        f"amp-backends bench: backend {result['backend']} on {result['device']}, torch {result['torch']}, {result['date']}",
        f"{size_note}: {sizes}",
        f"medians of {result['rounds']} interleaved rounds after {result['warmup']} warm-up steps "
        f"(emulated dtypes: {result['emulated_rounds']} rounds); steps per round: {steps or '1'}, timed by "
        f"{result.get('timer', 'the host clock')}; speedups are medians of per-round ratios [interquartile range]",
        f"memory: {kind}",
        "",
        table,
        "",
        "Adapter overhead vs torch.amp (median step-time ratio [interquartile range]): "
        + ("; ".join(overheads) if overheads else "not measured") + _resolution(result),
        "",
        "Recommendation (per model):",
        *advice,
    ])


def list_models(as_json: bool = False) -> str:
    """Each bench model with its parameter count at full size (and the reference's); JSON on request."""
    if as_json:
        import json

        return json.dumps([{"model": name, "params_full": param_count(name, "full"),
                            "reference_params": spec.reference_params or None,
                            "full_batch": spec.batch_sizes["full"], "full_shape": str(spec.shapes["full"]),
                            "params_small": param_count(name, "small"), "small_batch": spec.batch_sizes["small"],
                            "small_shape": str(spec.shapes["small"]), "what": spec.describe}
                           for name, spec in MODELS.items()], indent=2)
    rows = []
    for name, spec in MODELS.items():
        n = param_count(name, "full")
        ref = spec.reference_params
        diff = f"{100 * (n - ref) / ref:+.3f}%" if ref else ""
        rows.append([name, format_params(n), format_params(ref) if ref else "", diff,
                     f"{spec.batch_sizes['full']} x {spec.shapes['full']}",
                     f"{format_params(param_count(name, 'small'))}, {spec.batch_sizes['small']} x {spec.shapes['small']}",
                     spec.describe])
    return render_table(["model", "params (full)", "reference", "diff", "full batch", "small (CPU)", "what"],
                        rows, right=(1, 2, 3))


def plot(result: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AmpBackendsError("--plot needs matplotlib: pip install 'amp-backends[plot]'") from None
    rows = [r for r in result["rows"] if r["step_ms"] is not None and r["mode"] != "fp32"]
    labels = [f"{r['model']}\n{r['mode']}" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, len(rows)), 4))
    speed = [r["speedup_vs_fp32"] for r in rows]
    err = [[s - r["speedup_vs_fp32_iqr"][0] for s, r in zip(speed, rows)],
           [r["speedup_vs_fp32_iqr"][1] - s for s, r in zip(speed, rows)]]
    ax1.bar(labels, speed, yerr=err, color="tab:blue", capsize=3)
    ax1.axhline(1.0, color="gray", lw=1)
    ax1.set_title("speed vs fp32 (median, interquartile range)")
    ax1.tick_params(axis="x", labelsize=7)
    ax2.bar(labels, [r["mem_saving_pct"] for r in rows], color="tab:green")
    ax2.set_title(f"peak-memory saving, % ({rows[0]['memory_kind'] if rows else ''})")
    ax2.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{result['backend']} on {result['device']}, torch {result['torch']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


