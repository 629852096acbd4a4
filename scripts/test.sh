#!/usr/bin/env bash
# Installs everything (scripts/install.sh: the venv, lms-tf, Horovod) and runs the whole test suite,
# doctests included, on the newest tested TensorFlow / Keras pair (constraints/latest.txt), then
# the tests of the code that calls TensorFlow and Keras again on the oldest (constraints/oldest.txt,
# in .venv-oldest with its own Horovod build). Horovod has no wheel for these TensorFlow releases:
# each build is cached in $LMS_TF_CACHE. The first run includes tests/test_docker.py (the CPU image
# built with podman and a two-node Horovod job across two containers, scripts/test_docker.sh).
#
# The second run is what can differ between the two releases: the TensorFlow side (trace, rewrite,
# _compat's private APIs: tests/test_tf_*), the front-ends (Keras's train step, the optimizer,
# tf.data, Horovod: tests/test_frontends_*), the CLI and examples, the install, and every doctest.
# It leaves out the core's, planner's, simulator's, docs' and sizing CLI's tests (the TensorFlow
# they use, the trace and the allocator profile, is what the first group runs), the pipeline and hybrid runs (their own
# TensorFlow code, the pipeline step, the TF servers and the sharded layers, is tested on the
# newest pair only) and the image, which installs the newest pair: both runs in full took more
# than CI's 90 minutes. LMS_TF_OLDEST=all runs the whole suite there.
#
# Arguments go to pytest, and then only the newest pair runs (LMS_TF_OLDEST=1 runs the oldest pair
# with them too). Each run spreads the tests over LMS_TF_TEST_WORKERS processes (pytest-xdist,
# default 2, one per core of the machine CI runs on; 0 runs them in this process): a test that
# measures memory reads its own process's allocator or starts its own processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
status=0
workers=(-n "${LMS_TF_TEST_WORKERS:-2}")
.venv/bin/python -m pytest "${workers[@]}" "$@" || status=$?
if [ $# -eq 0 ] || [ "${LMS_TF_OLDEST:-0}" != 0 ]; then
    echo "lms-tf test: again on the oldest tested pair ($(grep -v '^#' constraints/oldest.txt | tr '\n' ' '))"
    LMS_TF_VENV=.venv-oldest LMS_TF_VERSIONS=oldest bash scripts/install.sh
    if [ $# -gt 0 ] || [ "${LMS_TF_OLDEST:-}" = all ]; then
        selection=(--ignore=tests/test_docker.py "$@")
    else
        selection=(tests/test_tf_*.py tests/test_frontends_*.py tests/test_cli_and_examples.py
                   tests/test_scripts_install.py lms_tf)
    fi
    .venv-oldest/bin/python -m pytest "${workers[@]}" "${selection[@]}" || status=$?
fi
exit $status
