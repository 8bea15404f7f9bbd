"""The training step against an independent reference: torch's own scaler and recipes (see
tests/differential.py), in random seeded programs. Every program runs with torch.amp.GradScaler
(the oracle), with amp_backends.GradScaler, and with each gradient-arena check; everything a user
can observe must be bitwise equal, in programs that also do what hostile loops do (autograd.grad
probes, a kept view with a pruned gradient, model surgery, the optimizer made again). A subset also
runs the whole step compiled, against the same step eager and against torch's scaler compiled the
same way.

    pytest tests/scaler/test_differential.py --fuzz-programs 5000      # thousands on demand
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
    # issue 38: autograd.grad reaching parameters the backward then does not (the branch not taken);
    # a kept view and a pruned gradient; surgery, with and without flat_grads() again later; optimizers made again
    assert sum(s["probe"] and not any(s["micro"]) for s in steps) > 20
    assert sum(s["prune"] for s in steps) > 100 and sum(s["recreate"] for s in steps) > 100
    assert {s["surgery"] for s in steps} == {None, *d.SURGERIES}
    later = [any(t["rebuild"] or t["recreate"] for t in p.steps[i + 1:]) for p in programs for i, s in enumerate(p.steps)
             if s["surgery"]]
    assert sum(later) > 20 and later.count(False) > 20


def test_the_generator_keeps_the_older_programs():
    """The hostile events are drawn from a generator of their own: without them, a seed's program is the one
    it always was (the fuzz's history, and failures reported by seed, stay comparable)."""
    program = d.make_program(7)
    assert (program.optimizer, program.impl, program.width, len(program.steps)) == ("adam", "foreach", 5, 3)
    assert [s["clear"] for s in program.steps] == ["keep", "opt-none", "opt-none"]
    assert [s["micro"] for s in program.steps] == [[True], [True, True, False], [False, True, True]]


def test_the_fuzz_sees_an_old_optimizer_kept_alive():
    """The oracle can fail on the new observations too: an arena that kept every optimizer it was given
    alive (as hooks holding the arena once did) is caught at the first program that makes one again."""
    import amp_backends

    kept = []
    original = amp_backends.flat_grads

    def keeping(optimizer, **kwargs):
        kept.append(optimizer)
        return original(optimizer, **kwargs)

    d.amp_backends.flat_grads = keeping
    try:
        seed = next(s for s in range(100) if any(step["recreate"] for step in d.make_program(s).steps))
        program = d.make_program(seed)
        assert d.first_difference(d.run(program, "torch"), d.run(program, "ours-arena-refcount")) is not None
    finally:
        d.amp_backends.flat_grads = original


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
