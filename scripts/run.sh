#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the main job: trace the Keras ResNet-50
# training step, swap its activations with lms-tf, and show the plan and the GPU peak
# before and after on Grappler's virtual 16 GB GPU. Extra arguments go to `lms-tf explain`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/lms-tf explain --model ResNet50 --batch 32 --input-shape 224x224 "$@"
