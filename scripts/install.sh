#!/usr/bin/env bash
# Installs everything: .venv with lms-tf (scripts/setup.sh), then Horovod built against its
# TensorFlow (scripts/install_horovod.sh). The test command and the Dockerfile both run this, the
# same way: the venv's bin first on PATH, as after `source .venv/bin/activate`, so the build must
# not depend on what the shell puts first (the Horovod build uses its own pinned CMake).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PATH="$PWD/.venv/bin:$PATH" bash scripts/install_horovod.sh .venv/bin/python
