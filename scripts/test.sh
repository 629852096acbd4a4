#!/usr/bin/env bash
# Installs everything (scripts/install.sh: the venv, lms-tf, Horovod) and runs the whole test suite,
# doctests included, on the newest tested TensorFlow / Keras pair (constraints/latest.txt), then
# again on the oldest (constraints/oldest.txt, in .venv-oldest with its own Horovod build). Horovod
# has no wheel for these TensorFlow releases: each build is cached in $LMS_TF_CACHE. The first run
# includes tests/test_docker.py (the CPU image built with podman and a two-node Horovod job across
# two containers, scripts/test_docker.sh); the image installs the newest pair, so the second run
# leaves it out. Arguments go to pytest, and then only the newest pair runs (LMS_TF_OLDEST=1 runs
# the oldest pair with them too). Each run spreads the tests over LMS_TF_TEST_WORKERS processes
# (pytest-xdist, default 2, one per core of the machine CI runs on; 0 runs them in this process):
# a test that measures memory reads its own process's allocator or starts its own processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
status=0
workers=(-n "${LMS_TF_TEST_WORKERS:-2}")
.venv/bin/python -m pytest "${workers[@]}" "$@" || status=$?
if [ $# -eq 0 ] || [ "${LMS_TF_OLDEST:-0}" = 1 ]; then
    echo "lms-tf test: the suite again on the oldest tested pair ($(grep -v '^#' constraints/oldest.txt | tr '\n' ' '))"
    LMS_TF_VENV=.venv-oldest LMS_TF_VERSIONS=oldest bash scripts/install.sh
    .venv-oldest/bin/python -m pytest "${workers[@]}" --ignore=tests/test_docker.py "$@" || status=$?
fi
exit $status
