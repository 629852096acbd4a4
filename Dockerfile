# lms-tf with Horovod (NCCL + MPI + Gloo) on CUDA GPUs, for one node or many.
#
#   docker build -t lms-tf .
#   docker run --gpus all --ipc=host --rm lms-tf \
#       bash scripts/launch.sh -- python examples/horovod_fit.py
#
# Every build step is a project script that CI also runs (scripts/install.sh, which
# scripts/test.sh runs before the tests); this file only adds the system packages a
# GPU node needs. Multi-node use (sshd on port 12345) is described in the README.
#
# CUDA 12.5 + cuDNN 9 matches TensorFlow 2.21's tensorflow[and-cuda] wheels; the -devel image
# brings nvcc, which Horovod's NCCL operations are compiled with.
FROM nvidia/cuda:12.5.1-cudnn-devel-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PIP_NO_CACHE_DIR=1 \
    LMS_TF_HOROVOD_GPU=1 \
    LMS_TF_EXTRAS=gpu,test \
    LMS_TF_CACHE=/opt/lms-tf-cache

# Python, a C++ toolchain for Horovod, NCCL headers, Open MPI and ssh for multi-node launches.
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev python3-pip g++ make git ca-certificates \
        libnccl2 libnccl-dev openmpi-bin libopenmpi-dev openssh-client openssh-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/run/sshd \
    && sed -i 's/^#\?Port .*/Port 12345/; s/^#\?PermitRootLogin .*/PermitRootLogin prohibit-password/' /etc/ssh/sshd_config \
    && echo "    StrictHostKeyChecking no" >> /etc/ssh/ssh_config \
    && echo "    Port 12345" >> /etc/ssh/ssh_config

WORKDIR /opt/lms-tf
COPY . .
# .venv with lms-tf[gpu,test], then Horovod built against that TensorFlow (NCCL, MPI, Gloo) with
# its pinned CMake: the same script the test command runs.
RUN bash scripts/install.sh

# Open MPI refuses to run as root without these two; the container is the unit of isolation.
ENV PATH=/opt/lms-tf/.venv/bin:$PATH \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

CMD ["bash", "scripts/launch.sh", "--", "python", "examples/horovod_fit.py"]
