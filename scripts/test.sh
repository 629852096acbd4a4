#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh, scripts/install_horovod.sh) and runs the whole test suite, doctests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Horovod has no wheel for TF 2.21: build it once (cached) so its tests and doctests run.
bash scripts/install_horovod.sh .venv/bin/python
exec .venv/bin/python -m pytest "$@"
