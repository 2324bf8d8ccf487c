#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite.
source "$(dirname "$0")/env.sh"
exec python -m pytest -q "$@"
