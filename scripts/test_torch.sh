#!/usr/bin/env bash
# Run tests on another supported torch: bash scripts/test_torch.sh 2.11.0 [pytest args]
# Builds .venv-torch<version> once (torch==<version>, then fsdptag with its test extra);
# the default tests are the subset CI runs on 2.11.0 and 2.14.1 (README, "Tested on").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version=${1:?usage: bash scripts/test_torch.sh <torch version> [pytest args]}
shift
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
venv=.venv-torch$version
if [ ! -x "$venv/bin/python" ]; then
    "$PY" -m venv "$venv"
fi
stamp=$venv/.fsdptag-installed
want=$( (echo "$version"; cat setup.cfg pyproject.toml) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "torch==$version"
    "$venv/bin/python" -m pip install -q -e '.[test]'
    echo "$want" > "$stamp"
fi
"$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$version', torch.__version__"
if [ $# -eq 0 ]; then
    set -- tests/unit tests/test_compat.py tests/test_tag.py tests/test_parametrize.py \
        tests/test_checkpoint.py tests/test_compile.py tests/test_estimate.py
fi
exec "$venv/bin/python" -m pytest -q "$@"
