#!/usr/bin/env bash
# Sets up everything lms-tf needs on a fresh machine: a virtualenv in .venv with lms-tf
# installed in editable mode plus its test extras (pinned TensorFlow, Keras, tf-keras).
# LMS_TF_EXTRAS picks other extras, e.g. LMS_TF_EXTRAS=gpu,test for tensorflow[and-cuda].
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "lms-tf setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
EXTRAS="${LMS_TF_EXTRAS:-test}"
echo "lms-tf setup: installing lms-tf[$EXTRAS] (TensorFlow, Keras and the extras' packages) into .venv"
.venv/bin/python -m pip install --quiet --progress-bar off -e ".[$EXTRAS]"
.venv/bin/lms-tf version
