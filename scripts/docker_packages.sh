#!/usr/bin/env bash
# The system packages of the lms-tf image (Dockerfile), on its Debian or Ubuntu base: Python with
# venv and headers, a C++ toolchain for Horovod's build, ssh for multi-node launches (sshd on port
# 12345, root by key only). With LMS_TF_HOROVOD_GPU=1 (the CUDA base) also NCCL and Open MPI;
# CPU images use Gloo, which needs nothing more.
set -euo pipefail
PACKAGES=(python3 python3-venv python3-dev g++ make git ca-certificates procps iproute2
          openssh-client openssh-server)
if [ "${LMS_TF_HOROVOD_GPU:-0}" = "1" ]; then
    PACKAGES+=(libnccl2 libnccl-dev openmpi-bin libopenmpi-dev)
fi
apt-get update
apt-get install -y --no-install-recommends "${PACKAGES[@]}"
rm -rf /var/lib/apt/lists/*
mkdir -p /var/run/sshd /root/.ssh
chmod 700 /root/.ssh
sed -i 's/^#\?Port .*/Port 12345/; s/^#\?PermitRootLogin .*/PermitRootLogin prohibit-password/' /etc/ssh/sshd_config
{
    echo "Host *"
    echo "    StrictHostKeyChecking no"
    echo "    UserKnownHostsFile /dev/null"
    echo "    LogLevel ERROR"
    echo "    Port 12345"
} >> /etc/ssh/ssh_config
