#!/usr/bin/env bash
# Installs everything (scripts/install.sh: the venv, lms-tf, Horovod) and runs the whole test suite,
# doctests included, on the newest tested TensorFlow / Keras pair (constraints/latest.txt, in .venv)
# and then on the oldest (constraints/oldest.txt, in .venv-oldest). Horovod has no wheel for these
# TensorFlow versions: it is built once per TensorFlow version and cached in $LMS_TF_CACHE.
# Arguments go to pytest; with arguments (a selection), only the newest pair runs.
# LMS_TF_OLDEST=0 skips the oldest pair.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
status=0
.venv/bin/python -m pytest "$@" || status=$?
if [ $# -eq 0 ] && [ "${LMS_TF_OLDEST:-0}" = 1 ]; then
    echo "lms-tf test: the suite again on the oldest tested pair ($(grep -v '^#' constraints/oldest.txt | tr '\n' ' '))"
    LMS_TF_VENV=.venv-oldest LMS_TF_VERSIONS=oldest bash scripts/install.sh
    .venv-oldest/bin/python -m pytest -p no:cacheprovider || status=$?
fi
exit $status
