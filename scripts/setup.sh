#!/usr/bin/env bash
# Sets up everything lms-tf needs on a fresh machine: a virtualenv with lms-tf installed in
# editable mode plus its test extras, TensorFlow, Keras and tf-keras pinned to a tested pair.
#   LMS_TF_EXTRAS    extras to install (default: test), e.g. gpu,test for tensorflow[and-cuda]
#   LMS_TF_VERSIONS  which pair of constraints/ (default: latest, the tested pair)
#   LMS_TF_VENV      where the virtualenv goes (default: .venv)
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${LMS_TF_VENV:-.venv}"
VERSIONS="${LMS_TF_VERSIONS:-latest}"
CONSTRAINTS="constraints/$VERSIONS.txt"
if [ ! -f "$CONSTRAINTS" ]; then
    echo "lms-tf setup: error: LMS_TF_VERSIONS=$VERSIONS names no file in constraints/ ($(ls constraints))" >&2
    exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "lms-tf setup: creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
EXTRAS="${LMS_TF_EXTRAS:-test}"
# What was installed, and from what: a second run with the same setup.py, constraints and extras
# needs no package index (an image's own test command runs offline).
STAMP="$VENV/.lms-tf-setup"
WANT="$(cat setup.py "$CONSTRAINTS" | sha256sum | cut -d' ' -f1) extras=$EXTRAS source=$PWD"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$VENV/bin/python" -c "import lms_tf" 2>/dev/null; then
    echo "lms-tf setup: $VENV already has lms-tf[$EXTRAS] with the $VERSIONS pair, nothing to do"
else
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    echo "lms-tf setup: installing lms-tf[$EXTRAS] with the $VERSIONS tested TensorFlow / Keras pair ($CONSTRAINTS) into $VENV"
    "$VENV/bin/python" -m pip install --quiet --progress-bar off -c "$CONSTRAINTS" -e ".[$EXTRAS]"
    echo "$WANT" > "$STAMP"
fi
"$VENV/bin/lms-tf" version
