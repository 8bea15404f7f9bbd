"""The training step against an independent reference: torch's own scaler and recipes (see
tests/differential.py), in random seeded programs. Every program runs with torch.amp.GradScaler
(the oracle), with amp_backends.GradScaler, and with each gradient-arena check; everything a user
can observe must be bitwise equal. A subset also runs the whole step compiled, against the same step
eager and against torch's scaler compiled the same way.

    pytest tests/test_differential.py --fuzz-programs 5000      # thousands on demand
"""

from __future__ import annotations

import warnings

import pytest
import torch

import differential as d

CHUNKS = 8


@pytest.fixture(autouse=True)
def _quiet_and_one_thread():
    threads = torch.get_num_threads()
    # Tiny ops: with pytest-xdist's workers on every core, torch's intra-op threads spin against each
    # other and a program takes 30x longer. One thread each; the arithmetic is the same.
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            # the per-tensor fallback's warning is expected where a program takes gradients out of the arena
            warnings.simplefilter("ignore", RuntimeWarning)
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_every_program_is_torchs_bitwise(chunk, request):
    programs = request.config.getoption("--fuzz-programs")
    failures = []
    for seed in range(chunk, programs, CHUNKS):
        program = d.make_program(seed)
        reference = d.run(program, "torch")
        for kind in d.KINDS[1:]:
            diff = d.first_difference(reference, d.run(program, kind))
            if diff:
                failures.append(f"seed {seed}, {kind}: {diff}\n  program: {program.describe()}")
    assert not failures, f"{len(failures)} differences from torch's scaler:\n" + "\n".join(failures[:5])


def test_the_programs_cover_what_they_claim():
    """The generator is no toy: over the CI's programs every optimizer, every clearing form, skips,
    clipping both ways, accumulation and late-used parameters occur."""
    programs = [d.make_program(seed) for seed in range(400)]
    steps = [s for p in programs for s in p.steps]
    assert {(p.optimizer, p.impl) for p in programs} >= {(o, i) for o in ("sgd", "adam", "adamw")
                                                          for i in ("foreach", "fused", "loop")}
    assert {s["clear"] for s in steps} == set(d.CLEARS)
    assert sum(s["inject"] for s in steps) > 100 and sum(s["hold"] for s in steps) > 100
    assert {s["clip"] for s in steps} == {None, "scaler", "recipe"}
    assert any(len(s["micro"]) > 1 for s in steps) and any(not any(s["micro"]) for s in steps)
    assert any(p.frozen_until for p in programs) and any(p.momentum for p in programs)


def test_the_fuzz_finds_a_gradient_left_scaled():
    """The oracle can fail: a scaler that forgets to unscale one gradient is caught at once."""
    from amp_backends.scaler.gradwork import GradientOp

    original = GradientOp.run

    def forgetful(self, optimizer, scale, found_inf, allow_fp16, norm_sq=None, known_normal=False, **kw):
        found = original(self, optimizer, scale, found_inf, allow_fp16, norm_sq, known_normal, **kw)
        first = next((p for g in optimizer.param_groups for p in g["params"] if p.grad is not None), None)
        if scale is not None and first is not None:
            first.grad.mul_(scale)  # that gradient still multiplied by the scale
        return found

    GradientOp.run = forgetful
    try:
        program = d.make_program(1)
        assert d.first_difference(d.run(program, "torch"), d.run(program, "ours")) is not None
    finally:
        GradientOp.run = original


BACKENDS = [("eager", 1.0), ("aot_eager", 0.5), ("inductor", 0.25)]


@pytest.mark.parametrize("backend,share", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_the_whole_step_compiled_equals_torchs_compiled_and_eager(backend, share, request):
    """One compiled function per iteration (clearing, forward, scaled backward, clip, step, update):
    ours compiled equals torch's scaler compiled the same way, with and without an arena; with the
    eager and aot_eager backends it also equals the same step run eagerly (inductor changes torch's own
    arithmetic: there the eager comparison is torch's compiled against torch's eager, equal to ours)."""
    count = max(1, int(request.config.getoption("--fuzz-compiled") * share))
    failures = []
    for seed in range(count):
        program = d.make_program(seed)
        torch_compiled = d.run(program, "torch", backend)
        for kind in ("ours", "ours-arena-refcount"):
            diff = d.first_difference(torch_compiled, d.run(program, kind, backend))
            if diff:
                failures.append(f"seed {seed} {kind} vs torch compiled: {diff}")
        eager = [s for s in d.run(program, "ours") if "after clear" not in s["where"]]
        reference = torch_compiled if backend != "inductor" else \
            [s for s in d.run(program, "torch") if "after clear" not in s["where"]]
        mine = d.run(program, "ours", backend) if backend != "inductor" else eager
        diff = d.first_difference(reference, mine)
        if diff:
            failures.append(f"seed {seed} eager vs compiled: {diff}")
    assert not failures, "\n".join(failures)
