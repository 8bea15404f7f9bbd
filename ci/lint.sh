#!/usr/bin/env bash
# Lint and types: ruff (the rules in pyproject.toml's [tool.ruff]) must pass clean; mypy ([tool.mypy]) may
# report only the errors listed in ci/mypy_baseline.txt, so a new one fails, and one fixed must leave the list.
# Runs in the main environment (.venv: torch and the integrations installed, so mypy sees their types).
set -euo pipefail
cd "$(dirname "$0")/.."

. .venv/bin/activate
. ci/pip_install.sh
pip_install "ruff==0.17.6" "mypy==2.4.1"
ruff --version
ruff check
mypy --version
python ci/mypy_baseline.py
