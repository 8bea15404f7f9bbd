#!/usr/bin/env bash
# One torch minor between the oldest and the main leg's, rotating: each run picks one of 2.5 ... 2.12 (by the
# CI run number where the runner gives one, else by the day of the year; MIDDLE_TORCH=2.11 picks it by hand)
# and says which in the log. A CPU build where torch's CPU index answers (the minors between the legs differ in
# their Python APIs, not in their CUDA libraries), else the registry's CUDA build, in a virtual environment of
# its own, with the torchao tested with that torch where one is (torch 2.11: torchao 0.17) and none otherwise
# (fp8's tests then assert the refusal).
#
# Not the whole suite (its budget is the other legs'): the version-sensitive tests, the ones that failed on a
# torch between the legs before: the simulated accelerator stacks and what their fused optimizers do, FSDP2 and
# DDP over gloo, torchao's fp8 and the precision plan, each device's autocast lists, the memory ledger against
# the allocator, the command's warnings, the saved-tensor hooks the activations' outputs are recomputed through.
set -euo pipefail
cd "$(dirname "$0")/.."

MINORS=(2.5 2.6 2.7 2.8 2.9 2.10 2.11 2.12)
if [[ -n "${MIDDLE_TORCH:-}" ]]; then
    minor="$MIDDLE_TORCH"
else
    run="${GITHUB_RUN_NUMBER:-${CI_PIPELINE_IID:-$((10#$(date +%j)))}}"
    minor="${MINORS[$((run % ${#MINORS[@]}))]}"
fi
declare -A TORCHAO=([2.11]="0.17.0")
torchao="${TORCHAO[$minor]:-}"
PYTHON="${MIDDLE_PYTHON:-python3}"
echo "middle torch leg: torch $minor.* (rotating over ${MINORS[*]}), torchao ${torchao:-none}, $($PYTHON --version)"

"$PYTHON" -m venv .venv-middle
. .venv-middle/bin/activate
python -m pip install --quiet --upgrade pip
. ci/pip_install.sh
# the CPU build where its index answers (a smaller download), else the registry's (a CUDA build; it runs on the CPU)
if python -m pip install --quiet --timeout 15 --retries 0 "torch==$minor.*" --index-url https://download.pytorch.org/whl/cpu \
    2> .venv-middle/cpu-index.log; then
    echo "middle torch leg: torch's CPU build"
elif echo "middle torch leg: torch's CPU index gave no installable build ($(tail -n 1 .venv-middle/cpu-index.log)); the registry's build" \
    && ! pip_install "torch==$minor.*"; then
    # the registry has no installable torch $minor, or its download failed on every attempt: nothing was tested
    echo "middle torch leg: torch $minor cannot be installed here (see pip's error above); the leg did not run"
    exit 0
fi
python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > .venv-middle/constraints.txt
[[ -n "$torchao" ]] && echo "torchao==$torchao" >> .venv-middle/constraints.txt
pip_install -c .venv-middle/constraints.txt -e . pytest pytest-xdist numpy ${torchao:+"torchao==$torchao"}
python -c "import torch; print('middle torch:', torch.__version__)"
python -c "from amp_backends.precision.fp8 import engine as fp8; print('fp8 training:', fp8.unavailable_reason() or 'available')"
python -m pytest -n auto -p no:cacheprovider -m "not slow" \
    tests/devices/test_fused.py tests/plugins/test_mlu.py tests/distributed/test_comms.py tests/devices/test_autocast_lists.py \
    tests/precision/test_plan.py tests/precision/test_mxfp8.py tests/cli/test_warning_format.py \
    tests/memory/test_substitutes.py \
    "tests/memory/test_memory.py::test_the_ledger_peak_is_the_allocators_and_its_parts_the_tensors_counted_directly"
