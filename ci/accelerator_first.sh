#!/usr/bin/env bash
# The suite as a machine with an accelerator sees it: ci/accelerator_first/ holds an installed
# plugin whose always-available backend ranks above every built-in (as cuda does on a GPU
# machine), so `amp_backends.get()` is not cpu. A test that assumes it is fails here.
# Runs in the main environment (.venv), after .ci/run has installed it.
set -euo pipefail
cd "$(dirname "$0")/.."

. .venv/bin/activate
export PYTHONPATH="$PWD/ci/accelerator_first${PYTHONPATH:+:$PYTHONPATH}"
python -c "import amp_backends; best = amp_backends.get().name; print('best backend in this leg:', best); assert best == 'sim-accelerator', best"
python -m pytest -n auto -p no:cacheprovider
