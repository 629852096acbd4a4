# lms-tf with Horovod, for one node or many: GPU nodes (the default, CUDA base) or CPU nodes.
#
#   docker build -t lms-tf .                                         # GPU: NCCL + MPI + Gloo
#   docker build -t lms-tf-cpu --build-arg BASE=debian:bookworm \
#       --build-arg LMS_TF_EXTRAS=test --build-arg LMS_TF_HOROVOD_GPU=0 .   # CPU: Gloo
#   docker run --gpus all --ipc=host --rm lms-tf \
#       bash scripts/launch.sh -- python examples/horovod_fit.py
#
# Every build step is a project script that CI also runs: scripts/docker_packages.sh (the system
# packages) and scripts/docker_install.sh (scripts/install.sh: .venv with lms-tf, then Horovod
# built against its TensorFlow). Where the package index is not reachable at build time, mount a
# wheelhouse made by scripts/docker_wheelhouse.sh at /wheelhouse (podman build -v DIR:/wheelhouse:ro)
# and the same scripts install from it, offline. scripts/test_docker.sh builds the CPU image that
# way and runs a two-node Horovod job across two containers. Multi-node use: docs/horovod.md.
#
# The CUDA base: CUDA 12.5 + cuDNN 9 match TensorFlow 2.21's tensorflow[and-cuda] wheels; the
# -devel image brings nvcc, which Horovod's NCCL operations are compiled with.
ARG BASE=nvidia/cuda:12.5.1-cudnn-devel-ubuntu22.04
FROM ${BASE}

# gpu,test and 1 on the CUDA base; test and 0 on a CPU base.
ARG LMS_TF_EXTRAS=gpu,test
ARG LMS_TF_HOROVOD_GPU=1
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PIP_NO_CACHE_DIR=1 \
    LMS_TF_EXTRAS=${LMS_TF_EXTRAS} \
    LMS_TF_HOROVOD_GPU=${LMS_TF_HOROVOD_GPU} \
    LMS_TF_CACHE=/opt/lms-tf-cache

# Python, a C++ toolchain for Horovod, ssh (sshd on port 12345) for multi-node launches; with
# GPUs also NCCL and Open MPI.
COPY scripts/docker_packages.sh /tmp/docker_packages.sh
RUN bash /tmp/docker_packages.sh

WORKDIR /opt/lms-tf
COPY . .
# .venv with lms-tf[$LMS_TF_EXTRAS], then Horovod built against that TensorFlow with its pinned
# CMake (or the wheel a mounted wheelhouse brings): the same script the test command runs.
RUN bash scripts/docker_install.sh

# Open MPI refuses to run as root without these two; the container is the unit of isolation.
ENV PATH=/opt/lms-tf/.venv/bin:$PATH \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

CMD ["bash", "scripts/launch.sh", "--", "python", "examples/horovod_fit.py"]
