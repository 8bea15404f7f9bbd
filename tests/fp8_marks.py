"""Skip markers for tests that need torchao's fp8 layers or its MX layer, with the engine's own reason."""

from __future__ import annotations

import pytest

from amp_backends.precision.fp8 import engine

NO_FP8 = engine.unavailable_reason()
NO_MX = engine.mx_unavailable_reason()
needs_torchao = pytest.mark.skipif(NO_FP8 is not None, reason=f"fp8 is unavailable here: {NO_FP8}")
needs_mx = pytest.mark.skipif(NO_MX is not None, reason=f"MXFP8 is unavailable here: {NO_MX}")
