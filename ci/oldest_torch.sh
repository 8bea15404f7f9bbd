#!/usr/bin/env bash
# The oldest torch the package claims (torch>=2.4): torch 2.4.0 (a CUDA build from the registry;
# it runs on the CPU) with the Triton it pulls in, in a virtual environment of its own.
# It runs the core, scaler, registry, distributed, CLI/demo and example tests; FSDP2-on-CPU
# tests skip there with their reason (torch 2.4's fully_shard needs CUDA streams).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv-torch24
. .venv-torch24/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.4.0" "numpy<2"   # torch 2.4 was built against numpy 1.x
echo "torch==2.4.0" > .venv-torch24/constraints.txt
python -m pip install --quiet -c .venv-torch24/constraints.txt -e . pytest pytest-xdist scikit-learn
python -c "import torch; print('oldest supported torch:', torch.__version__)"
python -m pytest -n auto -p no:cacheprovider \
    tests/test_scaler.py tests/test_scaler_torch.py tests/test_distributed.py tests/test_backend.py \
    tests/test_registry.py tests/test_hardware_truth.py tests/test_demo.py tests/test_examples.py \
    tests/test_integration_timm.py
