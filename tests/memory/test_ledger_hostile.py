"""The memory ledger where a count could go quietly wrong: the float32 gradients of a master-weight step,
ops whose fake kernels keep other bytes than the CPU's, storages an op resizes; and what ``bench --memory``
prints and refuses. Each figure is checked against one counted independently (live storages read
directly, a hand count) or against the real tensors' own count."""

from __future__ import annotations

import importlib.util
import re
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_backends
from amp_backends.memory.fake import Setup, measure, on_meta_then_fake
from amp_backends.memory.ledger import Ledger
from amp_backends.memory.master import MasterWeights


def _bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``, read from the storages themselves."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(seen.values())


# -- 1: the float32 gradients of the master step --------------------------------------------------------
def test_the_master_steps_float32_gradients_are_counted_as_gradients():
    """At batch 1 the peak is in the optimizer step, where the master step holds a float32 copy of every
    bfloat16 gradient: both are gradients (the copies were counted as "other")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024, dtype=torch.bfloat16))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = MasterWeights(inner)
    x = torch.randn(1, 1024).to(torch.bfloat16)
    copies: list[int] = []
    # the float32 gradients the wrapped optimizer steps on, read from their storages at its step
    inner.register_step_pre_hook(lambda o, *_: copies.append(_bytes(
        [p.grad for g in o.param_groups for p in g["params"]])))

    def step(ledger: Ledger) -> None:
        opt.zero_grad(set_to_none=True)
        with ledger.phase("forward"):
            loss = model(x).float().square().mean()
        with ledger.phase("backward"):
            loss.backward()
        with ledger.phase("optimizer"):
            opt.step()

    report = measure(lambda: Setup(model, opt, step, inputs=(x,), master=lambda: list(opt.masters.values())),
                     fake=False)
    n = sum(p.numel() for p in model.parameters())
    assert report.phase == "optimizer"
    assert copies[-1] == 4 * n  # the copies exist: 4 bytes a parameter
    low = _bytes([p.grad for p in model.parameters()])
    assert low == 2 * n
    # (where the peak falls on the cast itself, the bfloat16 concatenation it casts is a copy of them too)
    assert report.parts["gradients"] - low - copies[-1] in (0, low), report.parts


# -- 2: ops whose fake kernels differ from the CPU's --------------------------------------------------
class _Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.out = nn.LSTM(16, 32, batch_first=True), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0][:, -1])


class _TransposedNorm(nn.Module):
    """Batch norm over the channels of a (batch, length, channels) tensor, as sequence models call it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.bn, self.out = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.inp(x).transpose(1, 2)).transpose(1, 2)).mean(1)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def _count(build, loss_fn, fake: bool):
    def make() -> Setup:
        torch.manual_seed(0)
        model = on_meta_then_fake(build) if fake else build()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 32, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(ledger: Ledger) -> None:
            opt.zero_grad(set_to_none=True)
            with ledger.phase("forward"):
                out = model(x)
                loss = loss_fn(out if out.dim() == 2 else out.mean(1), y)
            with ledger.phase("backward"):
                loss.backward()
            with ledger.phase("optimizer"):
                opt.step()

        return Setup(model, opt, step, inputs=(x, y))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = measure(make, fake=fake)
    return report, [str(w.message) for w in caught if "memory ledger" in str(w.message)]


def _cross(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y.argmax(1))


@pytest.mark.parametrize(("build", "loss_fn", "op"), [
    (_Lstm, _cross, "aten.mkldnn_rnn_layer"),
    (_mlp, F.mse_loss, "aten.mse_loss"),
    (_TransposedNorm, _cross, "aten.native_batch_norm"),
], ids=["lstm workspace", "mse_loss buffer", "batch norm strides"])
def test_a_fake_count_that_differs_from_the_real_one_is_warned_of_naming_the_op(build, loss_fn, op):
    """The count on fake tensors differs from the real tensors' there (the CPU kernel keeps a workspace, a
    loss buffer, a contiguous copy that the fake kernel does not): the fake count warns, once, naming the
    op and the way out; the real count does not."""
    if build is _Lstm and not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN runs no mkldnn_rnn_layer")
    real, real_warned = _count(build, loss_fn, fake=False)
    fake, fake_warned = _count(build, loss_fn, fake=True)
    assert fake.peak != real.peak  # the difference the warning is about
    assert not real_warned
    named = [m for m in fake_warned if f"{op} " in m]
    assert len(named) == 1, fake_warned  # once, over both steps
    assert "real tensors" in named[0] and "fake=False" in named[0]


def test_a_fake_count_with_no_such_op_is_the_real_one_and_says_nothing():
    """A guard: where the fake kernels return what the CPU's do, the counts are equal and nothing is warned."""
    real, real_warned = _count(_mlp, _cross, fake=False)
    fake, fake_warned = _count(_mlp, _cross, fake=True)
    assert fake.peak == real.peak and fake.parts == real.parts
    assert not real_warned and not fake_warned


# -- 7: storages an op resizes -----------------------------------------------------------------------
def test_a_storage_an_op_resizes_is_counted_at_its_new_size_and_freed_once():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    ledger = Ledger()
    ledger.register([a, b])
    with ledger:
        buf = torch.empty(0)
        torch.mm(a, b, out=buf)  # the out= tensor's storage grows from 0 bytes
        grown = torch.empty(4)
        grown.resize_(128, 128)
        report = ledger.report()
    held = _bytes([a, b, buf, grown])
    assert buf.untyped_storage().nbytes() == 256 * 256 * 4
    assert ledger.live == held and ledger.peak == held
    assert report.parts["other"] == held and report.peak == held  # (a and b are named as nothing else either)
    del buf, grown
    assert ledger.live == _bytes([a, b])  # each storage's end counted once, at the size it had


# -- 5: the Ledger's own example --------------------------------------------------------------------
def test_the_ledger_docstring_example_runs_and_counts_the_step():
    code = re.search(r"\n((?:        .*\n|\s*\n)+)", Ledger.__doc__ or "").group(1)
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()  # the state exists before the step counted
    scope = {"Ledger": Ledger, "model": model, "opt": opt, "x": x, "y": y, "loss_fn": F.cross_entropy}
    exec(textwrap.dedent(code), scope)  # noqa: S102 - the docstring's example, run as written
    report = scope["report"]
    params = sum(p.numel() * 4 for p in model.parameters())
    assert report.parts["parameters"] == params and report.parts["gradients"] == params
    assert report.parts["optimizer"] == _bytes(scope["state"])


# -- 4: the loss of the amp-float16 row -------------------------------------------------------------
def test_the_amp_float16_rows_loss_is_evaluated_under_float16():
    from amp_backends.cli.bench_memory import loss_after, setup_for
    from amp_backends.cli.bench_models import MODELS
    from amp_backends.errors import PerformanceWarning

    be = amp_backends.get("cpu")
    if torch.float16 not in be.supported_dtypes():
        pytest.skip("no float16 autocast on this CPU backend")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        reported = loss_after(be, "mlp", "amp-float16", 2, 1e-2)
        setup = setup_for(be, "mlp", "small", None, "amp-float16", fake=False, lr=1e-2)()
        for _ in range(2):
            setup.step(Ledger())
        x, y = setup.inputs
        with torch.no_grad():
            by_dtype = {}
            for dtype in (torch.float16, torch.bfloat16):
                with torch.autocast("cpu", dtype=dtype):
                    by_dtype[dtype] = float(MODELS["mlp"].loss_of(setup.model, x, y).float())
    assert by_dtype[torch.float16] != by_dtype[torch.bfloat16]  # the check tells the two apart
    assert reported == by_dtype[torch.float16]


# -- 6, 8: the table --------------------------------------------------------------------------------
def _row(mode: str, peak: int, saving: float | None) -> dict:
    parts = {"parameters": 1_500_000, "gradients": 1_500_000, "optimizer": 3_000_000, "master": 0,
             "weight_copies": 0, "activations": 600_000, "other": 200_000}
    return {"model": "m", "mode": mode, "batch": 2, "input": "8 features", "peak_bytes": peak, "saving_vs_fp32": saving,
            "peak_kind": "ledger peak", "memory": {**parts, "peak": peak, "activations_by_dtype": {"float32": 600_000},
                                                   "peak_phase": "backward"}}


def test_the_memory_table_has_a_cell_per_column_tenths_of_mib_when_small_and_no_negative_zero():
    from amp_backends.cli.bench_memory import render_memory

    rows = [_row("fp32", 6_800_000, 0.0), _row("amp-bfloat16", 6_800_000, 0.0),
            {"model": "m", "mode": "lean-bf16-rc", "batch": 2, "input": "8 features", "memory": None,
             "saving_vs_fp32": None, "unavailable": "no repeated blocks"}]
    result = {"backend": "cpu", "torch": torch.__version__, "date": "today", "size": "small",
              "counted": "fake tensors (no arithmetic)", "loss_steps": 0, "loss_lr": 1e-4, "rows": rows}
    text = render_memory(result)
    table = [line for line in text.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]
    header = cells[0]
    assert all(header) and all(len(row) == len(header) for row in cells), table  # no column without a name
    assert cells[-1][-1].startswith("n/a: no repeated blocks"), table  # under "other; loss", the last column
    same = next(line for line in table if "amp-bfloat16" in line)
    assert "0.0%" in same and "-0.0%" not in same
    # 1,500,000 bytes are 1.43 MiB: whole MiB would print 1
    assert "| 1.4 |" in re.sub(r" +", " ", same), same
    assert "this machine's kernels" in text and "allocator's figure" in text


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_the_benchs_gpt2_trains_without_a_key_value_cache_in_every_mode():
    """The recompute lever drops GPT-2's cache in training (and advises ``use_cache=False``): every mode
    runs without it, so the rows compare the same model."""
    from amp_backends.cli.bench_models import MODELS

    spec = MODELS["hf-gpt2"]
    model = spec.build("small")
    x, _ = spec.batch("small", torch.device("cpu"), 1)
    assert model.training and getattr(model(input_ids=x), "past_key_values", None) is None
    assert "use_cache=False" in spec.describe


# -- 3: options bench --memory would ignore -------------------------------------------------------------
@pytest.mark.parametrize("extra", [["--plot", "out.png"], ["--rounds", "3"], ["--warmup", "1"],
                                   ["--steps-per-round", "2"]], ids=lambda e: e[0])
def test_timing_options_with_memory_are_refused_naming_them(capsys, extra):
    from amp_backends import cli

    # (the small size and no loss, so that a bench that runs instead of refusing is over in seconds)
    assert cli.main(["bench", "--memory", "--models", "mlp", "--size", "small", "--loss-steps", "0", *extra]) == 2
    err = capsys.readouterr().err
    assert extra[0] in err and "--memory" in err and "without --memory" in err and "Traceback" not in err
    assert err.count("\n") == 1
