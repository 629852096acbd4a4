#!/usr/bin/env bash
# Launches a data-parallel lms-tf training script with horovodrun.
#
# Usage: bash scripts/launch.sh [-np N] [-H HOSTS | --hostfile FILE] [other horovodrun options] -- COMMAND...
#
#   -np N            total ranks (default: the GPUs on this node; 2 CPU ranks on a node without GPUs)
#   -H host:slots,.. hosts and ranks per host (default: localhost:N); the other hosts are reached
#                    over ssh (passwordless), with lms-tf and Horovod installed at the same path
#   --hostfile FILE  one "host slots=N" per line, instead of -H
#   -p PORT          ssh port of the other hosts (e.g. the sshd of the lms-tf container, 12345)
#   COMMAND          the training command; a leading "python" is replaced by the interpreter
#                    that has lms-tf and Horovod (PYTHON, default .venv/bin/python of this checkout)
#
# Examples:
#   bash scripts/launch.sh -- python examples/horovod_fit.py                 # every GPU of this node
#   bash scripts/launch.sh -np 8 -H node1:4,node2:4 -p 12345 -- python train.py
#
# Horovod uses MPI when it was built with it (the Docker image) and Gloo otherwise; Gloo needs
# nothing but the horovodrun of the same Python.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
say() { echo "launch: $*" >&2; }

if [ ! -x "$PYTHON" ]; then
    say "error: no Python at '$PYTHON'. Run bash scripts/setup.sh, or set PYTHON=/path/to/python."
    exit 2
fi
HOROVODRUN="$(dirname "$PYTHON")/horovodrun"
if [ ! -x "$HOROVODRUN" ]; then
    say "error: $HOROVODRUN not found: Horovod is not installed in $PYTHON. Run: bash scripts/install_horovod.sh $PYTHON"
    exit 2
fi

OPTIONS=()
NP=""
HAVE_HOSTS=0
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case "$1" in
        -np|--num-proc) NP="$2"; shift 2 ;;
        -H|--hosts|--hostfile) HAVE_HOSTS=1; OPTIONS+=("$1" "$2"); shift 2 ;;
        *) OPTIONS+=("$1"); shift ;;
    esac
done
if [ $# -eq 0 ]; then
    say "error: no training command. Usage: bash scripts/launch.sh [-np N] [-H hosts] -- python train.py"
    exit 2
fi
shift  # the "--"
if [ $# -eq 0 ]; then
    say "error: nothing after '--'. Usage: bash scripts/launch.sh [-np N] [-H hosts] -- python train.py"
    exit 2
fi
COMMAND=("$@")
if [ "${COMMAND[0]}" = "python" ] || [ "${COMMAND[0]}" = "python3" ]; then
    COMMAND[0]="$PYTHON"
fi

if [ -z "$NP" ]; then
    GPUS=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    fi
    NP=$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)
fi
if ! [[ "$NP" =~ ^[1-9][0-9]*$ ]]; then
    say "error: -np must be a positive integer; received '$NP'."
    exit 2
fi
[ "$HAVE_HOSTS" = 1 ] || OPTIONS+=(-H "localhost:$NP")

# Rank processes import lms_tf from this checkout even when it is not pip-installed.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
say "$HOROVODRUN -np $NP ${OPTIONS[*]} ${COMMAND[*]}"
exec "$HOROVODRUN" -np "$NP" "${OPTIONS[@]}" "${COMMAND[@]}"
