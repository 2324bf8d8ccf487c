# Sourced by demo.sh and test.sh: create .venv and install fsdptag once.
# torch==2.13.0 is installed explicitly first: a bare `torch` requirement would
# pull a multi-GB CUDA build; setup.cfg then only asks for torch>=2.13.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.fsdptag-installed
want=$(cat setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q torch==2.13.0
    .venv/bin/python -m pip install -q -e '.[test]'
    echo "$want" > "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
