"""What torch.cuda answers on an NVIDIA or AMD machine, for tests of what the cuda backend declares
from it (no machine here has either GPU): set with pytest's monkeypatch, undone after the test."""

from __future__ import annotations

import contextlib
import types

import torch


def patch_rocm(monkeypatch, arch: str = "gfx942:sramecc+:xnack-", name: str = "AMD Instinct MI300X",
               hip: str = "6.2.41133-dd7f95766") -> None:
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.version, "cuda", None, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(gcnArchName=arch))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())


def patch_nvidia(monkeypatch, capability: tuple[int, int], name: str) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8", raising=False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    # torch.cuda.is_bf16_supported: native from 8.0, emulated (True unless including_emulation=False) before
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation or capability >= (8, 0))
