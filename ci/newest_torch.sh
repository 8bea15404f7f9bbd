#!/usr/bin/env bash
# The newest torch release, as the README's install gives it (`pip install "torch>=2.4"`: a CUDA
# build with the Triton it pulls in; it runs on the CPU), in a virtual environment of its own.
# Every later install is held to that torch by a constraint. The whole suite runs, as a machine with
# an accelerator sees it (ci/accelerator_first/: a plugin whose backend ranks above every built-in, as
# cuda does on a GPU machine), so no test can assume `amp_backends.get()` is cpu: one leg proves both.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv-newest
. .venv-newest/bin/activate
python -m pip install --quiet --upgrade pip
. ci/pip_install.sh
# Where the registry's download fails on every attempt, the log says so and the leg ends without a verdict.
if ! pip_install "torch>=2.4"; then
    echo "newest torch leg: torch could not be downloaded here (see pip's errors above); the leg did not run"
    exit 0
fi
python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > .venv-newest/constraints.txt
pip_install -c .venv-newest/constraints.txt -e ".[dev]"
python -c "import torch, triton; print('newest torch:', torch.__version__, 'triton:', triton.__version__)"
export PYTHONPATH="$PWD/ci/accelerator_first${PYTHONPATH:+:$PYTHONPATH}"
python -c "import amp_backends; best = amp_backends.get().name; print('best backend in this leg:', best); assert best == 'sim-accelerator', best"
# What this leg is for is torch and Triton at this version: the end-to-end runs through fresh
# processes (`slow`: the CLI, installed plugin distributions, the template package) and most of the
# differential fuzz run in the README's test command (the main leg), not again here.
python -m pytest -n auto -p no:cacheprovider -m "not slow" --fuzz-programs 100 --fuzz-compiled 1
