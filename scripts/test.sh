#!/usr/bin/env bash
# Installs everything (scripts/install.sh: the venv, lms-tf, Horovod) and runs the whole test suite,
# doctests included, on the tested TensorFlow / Keras pair (constraints/latest.txt). Horovod has no
# wheel for this TensorFlow: it is built once and cached in $LMS_TF_CACHE. The suite includes
# tests/test_docker.py: the CPU image built with podman and a two-node Horovod job across two
# containers (scripts/test_docker.sh). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest "$@"
