"""The whole training step under torch.compile: where torch's scaler compiles, ours compiles, with no
more graph breaks and no more graphs than torch's scaler in the same program (dynamo's own counters),
fused and foreach optimizers, the scaler's clip, gradient accumulation and the gradient arena.
(Equality of the results, compiled against eager and against torch's scaler compiled, is in
tests/scaler/test_differential.py.)"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import amp_backends

OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
}


def _counts(scaler_kind: str, optimizer: str, clip: bool, accumulate: int, arena: bool) -> tuple[int, int]:
    """(graphs, graph breaks) dynamo made compiling one step (backend "eager", 3 iterations)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = OPTIMIZERS[optimizer](model.parameters())
    if scaler_kind == "torch":
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    else:
        scaler = amp_backends.GradScaler("cpu", init_scale=1024.0)
        if arena:
            amp_backends.flat_grads(opt)

    def step(xs, y):
        for x in xs:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
        if clip and scaler_kind == "torch":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif clip:
            scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="eager")
    g = torch.Generator().manual_seed(1)
    xs, y = [torch.randn(4, 8, generator=g) for _ in range(accumulate)], torch.randn(4, 4, generator=g)
    for _ in range(3):
        compiled(xs, y)
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


CASES = [(o, clip, acc) for o in OPTIMIZERS for clip, acc in ((False, 1), (True, 2))]


@pytest.mark.parametrize("optimizer,clip,accumulate", CASES, ids=[f"{o}-{'clip-accumulate' if c else 'plain'}"
                                                                   for o, c, _ in CASES])
def test_no_more_graphs_or_breaks_than_torchs_scaler(optimizer, clip, accumulate):
    torch._logging.set_logs(dynamo=logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _counts("torch", optimizer, clip, accumulate, arena=False)
        ours = _counts("ours", optimizer, clip, accumulate, arena=False)
        arena = _counts("ours", optimizer, clip, accumulate, arena=True)
    assert ours[0] <= theirs[0] and ours[1] <= theirs[1], (ours, theirs)
    assert arena[0] <= theirs[0] and arena[1] <= theirs[1], (arena, theirs)


def test_the_scalers_methods_run_outside_the_graph_and_the_optimizer_step_inside():
    """As torch's scaler does: its own methods are not traced (one break where a compiled function
    calls them), while optimizer.step() called from scaler.step is compiled as a frame of its own."""
    from torch._dynamo.utils import counters

    torch._logging.set_logs(dynamo=logging.ERROR)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    scaler = amp_backends.GradScaler("cpu", init_scale=8.0)
    torch._dynamo.reset()
    counters.clear()

    @torch.compile(backend="eager")
    def step(x):
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt)
        scaler.update()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(torch.randn(2, 4))
    breaks = [r for r, n in counters["graph_break"].items() if "amp_backends" in r]
    assert not breaks, f"nothing inside the package's own code breaks a graph: {breaks}"
    assert counters["stats"]["unique_graphs"] >= 2, "the forward, and the optimizer's step, are graphs"
    assert scaler.stats.steps == 1 and not scaler.last_step_skipped
