#!/usr/bin/env bash
# Set up (first run only) and run the demo: a short training run on 2 CPU ranks.
source "$(dirname "$0")/env.sh"
exec torchrun --nproc-per-node 2 examples/train_llama.py --steps 8 "$@"
