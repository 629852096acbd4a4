#!/usr/bin/env bash
# The install step of the lms-tf image (Dockerfile): scripts/install.sh, online as in any docker
# build, or offline from a wheelhouse mounted at /wheelhouse (LMS_TF_WHEELHOUSE) made by
# scripts/docker_wheelhouse.sh: pip then takes every package from it (PIP_NO_INDEX,
# PIP_FIND_LINKS), and the Horovod wheel built on the host from its lms-tf cache.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELHOUSE="${LMS_TF_WHEELHOUSE:-/wheelhouse}"
if [ -d "$WHEELHOUSE" ] && ls "$WHEELHOUSE"/*.whl >/dev/null 2>&1; then
    echo "docker_install: offline, from the wheelhouse at $WHEELHOUSE"
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE"
    if [ -d "$WHEELHOUSE/lms-tf-cache" ]; then
        mkdir -p "$LMS_TF_CACHE"
        cp -r "$WHEELHOUSE/lms-tf-cache/." "$LMS_TF_CACHE/"
    fi
fi
bash scripts/install.sh
# The pinned build tools too (installed where Horovod is built, skipped when its wheel came from a
# cache): the image's own tests check them, offline.
bash scripts/install_horovod.sh --print-build-tools "${LMS_TF_VENV:-.venv}/bin/python"
