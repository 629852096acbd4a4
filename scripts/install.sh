#!/usr/bin/env bash
# Installs everything: a venv with lms-tf (scripts/setup.sh; LMS_TF_VENV, LMS_TF_VERSIONS and
# LMS_TF_EXTRAS pass through), then Horovod built against its TensorFlow
# (scripts/install_horovod.sh). The test command and the Dockerfile both run this, the same way:
# the venv's bin first on PATH, as after `source .venv/bin/activate`, so the build must not depend
# on what the shell puts first (the Horovod build uses its own pinned CMake).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LMS_TF_VENV:-.venv}"
bash scripts/setup.sh
PATH="$PWD/$VENV/bin:$PATH" bash scripts/install_horovod.sh "$VENV/bin/python"
