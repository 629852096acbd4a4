#!/usr/bin/env bash
# Builds Horovod 0.28.1 from its PyPI source archive against the TensorFlow already installed in
# the target Python, and installs it there.
#
# Horovod 0.28.1 (the last release) does not build against TF >= 2.16 as released: its
# horovod/tensorflow/CMakeLists.txt compiles xla_mpi_ops.cc, which includes XLA headers that
# moved. This script deletes that one line (lms-tf never uses Horovod's XLA ops) and builds with:
#   - Gloo on every machine (horovodrun --gloo, no MPI needed: CPU-only machines, tests, CI);
#   - NCCL (HOROVOD_GPU_OPERATIONS=NCCL) when CUDA (nvcc + a GPU driver, or nvcc alone with
#     LMS_TF_HOROVOD_GPU=1, as in the Dockerfile) is present, and MPI when mpicxx is.
#
# Idempotent: when Horovod 0.28.1 already imports in the target Python, its TensorFlow ops load
# and it was built against the TensorFlow version installed now, it does nothing and says so.
# The built wheel is cached per (TF version, Python, build flavour) in $LMS_TF_CACHE
# (default ~/.cache/lms-tf), so a fresh virtualenv with the same TensorFlow installs it
# in seconds; a TensorFlow upgrade triggers a rebuild.
#
# Build tools are pinned (BUILD_TOOLS below) and the build uses the CMake installed into the target
# environment (HOROVOD_CMAKE), never whatever `cmake` comes first on PATH: an activated venv with an
# unpinned PyPI CMake (4.x) or a base image without a system CMake must build the same way.
#
# Usage: bash scripts/install_horovod.sh [PYTHON]      (default: .venv/bin/python)
#        FORCE=1 bash scripts/install_horovod.sh        (rebuild even if a matching build imports)
#        bash scripts/install_horovod.sh --print-build-tools [PYTHON]
#                                                       (install the pinned build tools, print the
#                                                        CMake the build would use and its version)
set -euo pipefail
cd "$(dirname "$0")/.."

PRINT_BUILD_TOOLS=0
if [ "${1:-}" = "--print-build-tools" ]; then PRINT_BUILD_TOOLS=1; shift; fi
PYTHON="${1:-${PYTHON:-.venv/bin/python}}"
HOROVOD_VERSION="0.28.1"
# Pinned build tools, each for a reason:
#   cmake 3.31.x: the last CMake line that still configures Horovod 0.28.1's vendored Gloo and
#     FlatBuffers (cmake_minimum_required 2.8.12); CMake 4 removed compatibility with < 3.5 and fails
#     ("Compatibility with CMake < 3.5 has been removed"). Horovod itself needs >= 3.13.
#   setuptools 80.10.2, wheel 0.45.1: the newest pair below setuptools 81 (which drops long-deprecated
#     build APIs a 2023 setup.py may use); what `pip wheel --no-build-isolation` takes from the
#     target environment, so the build does not depend on what the user's venv happened to have.
#   packaging: Horovod's setup.py parses the CMake version with it; any current release does.
BUILD_TOOLS=("cmake==3.31.6" "setuptools==80.10.2" "wheel==0.45.1" "packaging>=22")
CACHE="${LMS_TF_CACHE:-$HOME/.cache/lms-tf}"
say() { echo "install_horovod: $*"; }

if [ ! -x "$PYTHON" ]; then
    say "error: no Python interpreter at '$PYTHON'. Run scripts/setup.sh first or pass the interpreter: bash scripts/install_horovod.sh /path/to/python" >&2
    exit 2
fi
TF_VERSION="$("$PYTHON" -c 'import importlib.metadata as m
for d in ("tensorflow", "tensorflow-cpu"):
    try:
        print(m.version(d)); break
    except m.PackageNotFoundError:
        pass' 2>/dev/null || true)"
if [ -z "$TF_VERSION" ]; then
    say "error: TensorFlow is not installed in $PYTHON; Horovod must be built against it. Install lms-tf first (scripts/setup.sh)." >&2
    exit 2
fi
PY_TAG="$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"

# The build flavour: GPU operations only where CUDA can compile them.
FLAVOUR="gloo"
BUILD_ENV=(HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1)
# LMS_TF_HOROVOD_GPU=1 builds the NCCL operations whenever nvcc exists, without a GPU driver
# (a `docker build` sees no GPU); =0 never builds them; unset: only where a GPU answers.
WANT_GPU="${LMS_TF_HOROVOD_GPU:-auto}"
if [ "$WANT_GPU" = "1" ] && ! command -v nvcc >/dev/null 2>&1; then
    say "error: LMS_TF_HOROVOD_GPU=1 but nvcc is not on PATH; install the CUDA toolkit (a -devel CUDA image)" >&2
    exit 2
fi
if [ "$WANT_GPU" = "1" ] || { [ "$WANT_GPU" = "auto" ] && command -v nvcc >/dev/null 2>&1 \
        && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; }; then
    FLAVOUR="$FLAVOUR-nccl"
    BUILD_ENV+=(HOROVOD_GPU_OPERATIONS=NCCL)
    [ -n "${NCCL_HOME:-}" ] && BUILD_ENV+=(HOROVOD_NCCL_HOME="$NCCL_HOME")
fi
if command -v mpicxx >/dev/null 2>&1; then
    FLAVOUR="$FLAVOUR-mpi"
    BUILD_ENV+=(HOROVOD_WITH_MPI=1)
else
    BUILD_ENV+=(HOROVOD_WITHOUT_MPI=1)
fi
STAMP_TEXT="horovod=$HOROVOD_VERSION tensorflow=$TF_VERSION python=$PY_TAG flavour=$FLAVOUR"

# What "a matching build imports" means: the package imports, its TF op library loads into this
# TensorFlow (an ABI mismatch fails here), and the stamp written at install time names this TF.
check_installed() {
    "$PYTHON" - "$STAMP_TEXT" <<'EOF'
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
try:
    import horovod
    import horovod.tensorflow as hvd
    from horovod.tensorflow import mpi_ops  # loads mpi_lib.so into TensorFlow
except Exception as error:  # noqa: BLE001 - any failure means "not usable", reported below
    print(f"not usable: {type(error).__name__}: {error}")
    sys.exit(1)
stamp = os.path.join(os.path.dirname(horovod.__file__), "LMS_TF_BUILD")
found = open(stamp).read().strip() if os.path.exists(stamp) else "no build stamp"
if horovod.__version__ != "0.28.1" or found != sys.argv[1]:
    print(f"built for a different setup ({found}; horovod {horovod.__version__})")
    sys.exit(1)
print(f"Horovod {horovod.__version__} with TensorFlow ops, gloo={hvd.gloo_built()}, "
      f"mpi={hvd.mpi_built()}, nccl={bool(hvd.nccl_built())}")
EOF
}

# Installs the pinned build tools into the target environment and prints the CMake executable they
# provide. Horovod's setup.py runs $HOROVOD_CMAKE when it is set, so the build uses exactly this one.
install_build_tools() {
    "$PYTHON" -m pip install --quiet --progress-bar off "${BUILD_TOOLS[@]}" cloudpickle psutil pyyaml >&2
    "$PYTHON" - <<'EOF'
import os, sys, sysconfig
cmake = os.path.join(sysconfig.get_path("scripts"), "cmake")
if not os.access(cmake, os.X_OK):
    sys.exit(f"install_horovod: error: the pinned cmake did not install an executable at {cmake}")
print(cmake)
EOF
}

if [ "$PRINT_BUILD_TOOLS" = "1" ]; then
    CMAKE_BIN="$(install_build_tools)"
    echo "cmake=$CMAKE_BIN"
    "$CMAKE_BIN" --version | head -n 1
    exit 0
fi

if [ "${FORCE:-0}" != "1" ] && status="$(check_installed 2>/dev/null)"; then
    say "already installed, nothing to do: $status ($STAMP_TEXT)"
    exit 0
fi
say "installing Horovod $HOROVOD_VERSION for TensorFlow $TF_VERSION, $PY_TAG, flavour $FLAVOUR"

WHEEL_DIR="$CACHE/horovod-$HOROVOD_VERSION-tf$TF_VERSION-$PY_TAG-$FLAVOUR"
if [ "${FORCE:-0}" = "1" ]; then rm -rf "$WHEEL_DIR"; fi
if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
    # Build requirements that --no-build-isolation expects in the target environment, pinned.
    CMAKE_BIN="$(install_build_tools)"
    say "building with $("$CMAKE_BIN" --version | head -n 1) at $CMAKE_BIN"
    BUILD_ENV+=(HOROVOD_CMAKE="$CMAKE_BIN")
    say "downloading the horovod==$HOROVOD_VERSION source archive from PyPI"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
        -d "$WORK" "horovod==$HOROVOD_VERSION"
    tar -xzf "$WORK/horovod-$HOROVOD_VERSION.tar.gz" -C "$WORK"
    SRC="$WORK/horovod-$HOROVOD_VERSION"
    CMAKELISTS="$SRC/horovod/tensorflow/CMakeLists.txt"
    if ! grep -q "xla_mpi_ops.cc" "$CMAKELISTS"; then
        say "error: $CMAKELISTS no longer names xla_mpi_ops.cc; the patch this script applies does not fit this source archive" >&2
        exit 1
    fi
    # The one change: drop XLA's MPI ops, whose XLA headers moved in TF >= 2.16.
    sed -i '/xla_mpi_ops\.cc/d' "$CMAKELISTS"
    say "building the wheel (1.5-3 minutes on 2 cores here; compiler output in $WORK/build.log)"
    mkdir -p "$WHEEL_DIR.partial"
    if ! env "${BUILD_ENV[@]}" MAKEFLAGS="-j$(nproc)" "$PYTHON" -m pip wheel --no-deps \
            --no-build-isolation -w "$WHEEL_DIR.partial" "$SRC" >"$WORK/build.log" 2>&1; then
        tail -n 40 "$WORK/build.log" >&2
        say "error: the Horovod build failed (last lines above)" >&2
        exit 1
    fi
    rm -rf "$WHEEL_DIR" && mv "$WHEEL_DIR.partial" "$WHEEL_DIR"
else
    say "using the wheel built earlier for this TensorFlow: $(ls "$WHEEL_DIR"/horovod-*.whl)"
fi

"$PYTHON" -m pip install --quiet --progress-bar off --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl
"$PYTHON" -m pip install --quiet --progress-bar off cloudpickle psutil pyyaml packaging
SITE_DIR="$("$PYTHON" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("horovod").origin))')"
echo "$STAMP_TEXT" > "$SITE_DIR/LMS_TF_BUILD"

if ! status="$(check_installed)"; then
    say "error: Horovod installed but its TensorFlow ops do not load: $status" >&2
    exit 1
fi
say "done: $status"
