#!/usr/bin/env bash
# Installs everything (scripts/install.sh: the venv, lms-tf, Horovod) and runs the whole test suite,
# doctests included, on the newest tested TensorFlow / Keras pair (constraints/latest.txt, in .venv)
# and then on the oldest (constraints/oldest.txt, in .venv-oldest). Horovod has no wheel for these
# TensorFlow versions: it is built once per TensorFlow version and cached in $LMS_TF_CACHE.
# The suite includes tests/test_docker.py: the CPU image built with podman and a two-node Horovod
# job across two containers (scripts/test_docker.sh). Arguments go to pytest; with arguments (a
# selection), only the newest pair runs.
# LMS_TF_OLDEST=0 skips the oldest pair.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
status=0
.venv/bin/python -m pytest "$@" || status=$?
if [ $# -eq 0 ] && [ "${LMS_TF_OLDEST:-0}" = 1 ]; then
    echo "lms-tf test: the suite again on the oldest tested pair ($(grep -v '^#' constraints/oldest.txt | tr '\n' ' '))"
    LMS_TF_VENV=.venv-oldest LMS_TF_VERSIONS=oldest bash scripts/install.sh
    # The image test builds the latest pair's image: it ran with the suite above.
    .venv-oldest/bin/python -m pytest --deselect tests/test_docker.py::test_the_image_trains_across_two_containers \
        || status=$?
fi
exit $status
