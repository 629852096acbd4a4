#!/usr/bin/env bash
# Sets up everything lms-tf needs on a fresh machine: a virtualenv in .venv with lms-tf
# installed in editable mode plus its test extras (pinned TensorFlow, Keras, tf-keras).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "lms-tf setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
echo "lms-tf setup: installing lms-tf[test] (TensorFlow, Keras, tf-keras, pytest) into .venv"
.venv/bin/python -m pip install --quiet --progress-bar off -e ".[test]"
.venv/bin/lms-tf version
