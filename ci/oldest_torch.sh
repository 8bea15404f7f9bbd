#!/usr/bin/env bash
# The oldest torch the package claims (torch>=2.4): torch 2.4.0 (a CUDA build from the registry;
# it runs on the CPU) with the Triton it pulls in (3.0.0), in a virtual environment of its own.
# The whole suite runs; what cannot run there skips with its reason: the simulated PrivateUse1
# device (torch 2.4 lacks the Python-backend registration it needs), FSDP2 on CPU (torch 2.4's
# fully_shard creates CUDA streams), and the Lightning/Accelerate/Transformers integration tests
# (those frameworks are installed only in the main environment), and fp8 training (torchao does not
# import on torch 2.4: its tests assert the refusal instead).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv-torch24
. .venv-torch24/bin/activate
python -m pip install --quiet --upgrade pip
. ci/pip_install.sh
# torch 2.4 was built against numpy 1.x. Its wheel is fetched from the registry: where the download fails on
# every attempt, the log says so and the leg ends without a verdict (the network's failure, not the project's).
if ! pip_install "torch==2.4.0" "numpy<2"; then
    echo "oldest torch leg: torch 2.4.0 could not be downloaded here (see pip's errors above); the leg did not run"
    exit 0
fi
echo "torch==2.4.0" > .venv-torch24/constraints.txt
pip_install -c .venv-torch24/constraints.txt -e . pytest pytest-xdist scikit-learn \
    "setuptools>=70.1" matplotlib
python -c "import torch, triton; print('oldest supported torch:', torch.__version__, 'triton:', triton.__version__)"
# fp8 (torchao) is not installed here: no torchao release this project uses imports on torch 2.4. Say so.
python -c "from amp_backends.precision.fp8 import engine as fp8; print('fp8 training:', fp8.unavailable_reason() or 'available')"
# What this leg is for is torch and Triton at this version: the end-to-end runs through fresh
# processes (`slow`: the CLI, installed plugin distributions, the template package) and most of the
# differential fuzz run in the README's test command (the main leg), not again here.
python -m pytest -n auto -p no:cacheprovider -m "not slow" --fuzz-programs 100 --fuzz-compiled 1
