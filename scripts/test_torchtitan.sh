#!/usr/bin/env bash
# Run the torchtitan tests (tests/torchtitan): bash scripts/test_torchtitan.sh [pytest args]
# Builds .venv-torchtitan once (torch==2.13.0, then fsdptag with its test and torchtitan
# extras): torchtitan 0.3.0's dependencies (datasets, wandb, tensorboard, triton) stay out
# of the main venv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
venv=.venv-torchtitan
if [ ! -x "$venv/bin/python" ]; then
    "$PY" -m venv "$venv"
fi
stamp=$venv/.fsdptag-installed
want=$(cat setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q torch==2.13.0
    "$venv/bin/python" -m pip install -q -e '.[test,torchtitan]'
    echo "$want" > "$stamp"
fi
if [ $# -eq 0 ]; then
    set -- tests/torchtitan
fi
export PATH="$PWD/$venv/bin:$PATH"
exec "$venv/bin/python" -m pytest -q "$@"
