#!/usr/bin/env bash
# Makes a wheelhouse for building the CPU image where the package index is not reachable from
# inside a build: every wheel lms-tf[test] needs with the latest tested TensorFlow / Keras pair,
# pip's build tools, and the Horovod wheel scripts/install_horovod.sh built for this TensorFlow
# (from $LMS_TF_CACHE, built first if missing). The image and this host must share the Python
# minor version and the C library (Debian 12, Python 3.11 both).
#
# Usage: bash scripts/docker_wheelhouse.sh DIR     (idempotent: present wheels are kept)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:?usage: bash scripts/docker_wheelhouse.sh DIR}"
CACHE="${LMS_TF_CACHE:-$HOME/.cache/lms-tf}"
mkdir -p "$DIR"
say() { echo "docker_wheelhouse: $*"; }
[ -x .venv/bin/python ] || bash scripts/install.sh
TF_VERSION="$(grep '^tensorflow==' constraints/latest.txt | cut -d= -f3)"
PY_TAG="$(.venv/bin/python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
HOROVOD_DIR="horovod-0.28.1-tf$TF_VERSION-$PY_TAG-gloo"
if ! ls "$CACHE/$HOROVOD_DIR"/horovod-*.whl >/dev/null 2>&1; then
    say "no Horovod wheel for TensorFlow $TF_VERSION in $CACHE yet: building it"
    PATH="$PWD/.venv/bin:$PATH" LMS_TF_HOROVOD_GPU=0 bash scripts/install_horovod.sh .venv/bin/python
fi
say "downloading the wheels of lms-tf[test] (constraints/latest.txt) and pip's build tools into $DIR"
# Resolved for the image's Python (Debian 12's 3.11.2; LMS_TF_IMAGE_PYTHON), not this host's: some
# packages' newest releases need a later 3.11.
.venv/bin/python -m pip download --quiet --progress-bar off -d "$DIR" -c constraints/latest.txt \
    --python-version "${LMS_TF_IMAGE_PYTHON:-3.11.2}" --only-binary=:all: \
    ".[test]" pip "setuptools==80.10.2" "wheel==0.45.1" "cmake==3.31.6" cloudpickle psutil pyyaml packaging
rm -f "$DIR"/lms_tf-*  # the image installs lms-tf from its own copy of the source
mkdir -p "$DIR/lms-tf-cache"
rm -rf "${DIR:?}/lms-tf-cache/$HOROVOD_DIR"
cp -r "$CACHE/$HOROVOD_DIR" "$DIR/lms-tf-cache/"
say "done: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1)"
