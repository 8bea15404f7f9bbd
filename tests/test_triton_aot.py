"""The Triton kernel compiled ahead of time for sm_80, sm_90 and gfx942 on this (GPU-less) machine:
every specialisation the launches use compiles, the aligned ones move 128 bits per access, none spills."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton", reason="the triton extra is not installed")


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(out.parent / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "amp_backends_plugins.triton.aot", "--json", str(out), "--stand-in-linker"],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["triton"] == triton.__version__
    return data["variants"]


def test_every_specialisation_compiles_for_every_target(variants):
    assert len(variants) == 3 * 3 * 4 * 2  # targets x dtypes x ops x alignment
    assert {v["target"] for v in variants} == {"sm_80", "sm_90", "gfx942"}
    assert [v for v in variants if v["error"]] == []


def test_aligned_blocks_move_128_bits_per_access(variants):
    aligned = [v for v in variants if v["aligned"]]
    assert aligned and all(v["load_bits"] == 128 for v in aligned)
    writes = [v for v in aligned if v["op"].startswith("unscale")]
    assert writes and all(v["store_bits"] == 128 for v in writes)
    nvidia = [v for v in aligned if v["target"].startswith("sm_")]
    assert nvidia and all(v["sass_load_bits"] == 128 for v in nvidia), "LDG.E.128 in the machine code"


def test_unaligned_bases_stay_scalar_and_correct_by_construction(variants):
    """A base off 16 bytes (a DDP bucket view after a 37-element bias) must not get vector accesses."""
    unaligned = [v for v in variants if not v["aligned"]]
    assert all(v["store_bits"] <= 32 for v in unaligned)
    assert all(v["sass_load_bits"] in (None, 32, 64) for v in unaligned)  # 64: the block table's int64 offsets


def test_no_register_spills(variants):
    assert all(v["spills"] == 0 for v in variants)
    assert all(v["registers"] and v["registers"] <= 128 for v in variants)
