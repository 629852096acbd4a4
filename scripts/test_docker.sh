#!/usr/bin/env bash
# Builds the CPU image and runs a two-node Horovod job across two containers, with podman (no Docker
# daemon is needed; every step is what a Docker user's build runs, from the same Dockerfile).
#
#  1. podman, runc and debootstrap from Debian's packages when missing (root), podman set to runc
#     (crun fails on cgroups here) and to no default ulimits;
#  2. a Debian 12 base image made locally (no registry is needed): debootstrap --variant=minbase,
#     imported as localhost/debian-min:bookworm, its root file system cached in $LMS_TF_CACHE;
#  3. a wheelhouse for the image (scripts/docker_wheelhouse.sh, cached in $LMS_TF_CACHE), mounted
#     into the build, which installs from it offline;
#  4. the image: Dockerfile with BASE=localhost/debian-min:bookworm, LMS_TF_EXTRAS=test,
#     LMS_TF_HOROVOD_GPU=0 (Gloo);
#  5. two containers, node1 and node2, on one podman network, each running the image's sshd with
#     one throw-away key; scripts/launch.sh from node1 with -H node1:1,node2:1 trains
#     examples/horovod_fit.py on 2 ranks (LMSCallback + DistributedCallback): both ranks must end
#     with the same weights checksum, and rank 0's weights must equal a one-process run on the
#     global batches (--as-ranks 2) within 1e-5;
#  6. the job again, with node2 killed once training has started: the launcher must exit non-zero
#     within LMS_TF_KILL_SECONDS (default 120);
#  7. (before 6) lms-tf launch --hosts node1,node2: a 2-stage pipeline with stage 1 started on node2
#     over ssh, bit-identical to gradient accumulation in one process.
# Prints one closing line, "docker: N passed, N failed", and exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${LMS_TF_CACHE:-$HOME/.cache/lms-tf}"
IMAGE=localhost/lms-tf-cpu:test
BASE=localhost/debian-min:bookworm
NETWORK=lms-tf-test
KILL_SECONDS="${LMS_TF_KILL_SECONDS:-120}"
WORK="$(mktemp -d)"
say() { echo "test_docker: $*" >&2; }
passed=0 failed=0
check() {  # check NAME CONDITION-EXIT-CODE DETAIL
    if [ "$2" = 0 ]; then passed=$((passed + 1)); say "PASS $1"; else failed=$((failed + 1)); say "FAIL $1: $3"; fi
}
cleanup() {
    podman rm -f -t 0 node1 node2 >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

# 1. Tools.
if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null; then
    say "installing podman, runc and debootstrap from Debian's packages"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap >/dev/null
fi
if [ ! -f /etc/containers/containers.conf ] || ! grep -q '^runtime = "runc"' /etc/containers/containers.conf; then
    mkdir -p /etc/containers
    printf '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n' > /etc/containers/containers.conf
fi

# 2. The base image.
if ! podman image exists "$BASE"; then
    ROOTFS="$CACHE/docker/debian-min-bookworm.tar"
    if [ ! -f "$ROOTFS" ]; then
        say "making a Debian 12 minbase root file system with debootstrap (about 30 s)"
        mkdir -p "$CACHE/docker"
        debootstrap --variant=minbase bookworm "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 \
            || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
        tar -C "$WORK/rootfs" -cf "$ROOTFS.partial" . && mv "$ROOTFS.partial" "$ROOTFS"
        rm -rf "$WORK/rootfs"
    fi
    podman import -q "$ROOTFS" "$BASE" >/dev/null
fi

# 3. The wheelhouse, 4. the image.
WHEELHOUSE="$CACHE/docker/wheelhouse"
bash scripts/docker_wheelhouse.sh "$WHEELHOUSE" >&2
say "building $IMAGE from the Dockerfile (CPU base, offline from the wheelhouse)"
started=$SECONDS
podman build -q --network=host -v "$WHEELHOUSE:/wheelhouse:ro" -t "$IMAGE" --build-arg BASE="$BASE" \
    --build-arg LMS_TF_EXTRAS=test --build-arg LMS_TF_HOROVOD_GPU=0 . >"$WORK/build.log" 2>&1 \
    || { tail -30 "$WORK/build.log" >&2; exit 1; }
say "image built in $((SECONDS - started)) s"
podman image prune -f >/dev/null 2>&1 || true  # the previous build of the tag (3 GB each) goes

# 5. Two nodes.
ssh-keygen -q -t ed25519 -N "" -f "$WORK/id_ed25519"
cp "$WORK/id_ed25519.pub" "$WORK/authorized_keys"
# The network is kept between runs, on a fixed subnet: podman 4.3's DNS server (aardvark-dns 1.4)
# keeps answering on the old gateway when a network of the same name is removed and made again on
# the next free subnet, and the containers then cannot resolve each other.
if ! podman network exists "$NETWORK"; then
    podman network create --subnet 10.89.77.0/24 "$NETWORK" >/dev/null
fi
for node in node1 node2; do
    podman rm -f -t 0 "$node" >/dev/null 2>&1 || true
    podman run -d --name "$node" --hostname "$node" --network "$NETWORK" -v "$WORK:/keys:ro" "$IMAGE" \
        bash -c 'install -m 600 /keys/id_ed25519 /keys/authorized_keys /root/.ssh/ && exec /usr/sbin/sshd -D -e' >/dev/null
done
for node in node1 node2; do  # sshd is up, and node1 reaches each node by name
    reached=1
    for _ in $(seq 30); do
        if podman exec node1 ssh -o ConnectTimeout=5 "$node" true 2>"$WORK/ssh.log"; then reached=0; break; fi
        sleep 1
    done
    if [ "$reached" != 0 ]; then
        say "error: node1 cannot ssh to $node by name: $(tail -1 "$WORK/ssh.log")"
        exit 1
    fi
done
LAUNCH=(bash scripts/launch.sh -np 2 -H node1:1,node2:1 -p 12345 -- python examples/horovod_fit.py
        --optimizer sgd --no-shuffle)
say "2 ranks across node1 and node2: ${LAUNCH[*]}"
started=$SECONDS
status=0
podman exec node1 "${LAUNCH[@]}" --weights-out /tmp/two_nodes.npz >"$WORK/job.log" 2>&1 || status=$?
say "the job took $((SECONDS - started)) s"
checksums="$(grep -o 'rank [01]/2 on node[12]: .*weights checksum [-0-9.]*' "$WORK/job.log" | sed 's/.*checksum //' | sort -u)"
on_node1="$(grep -c 'rank 0/2 on node1: .*weights checksum' "$WORK/job.log" || true)"
on_node2="$(grep -c 'rank 1/2 on node2: .*weights checksum' "$WORK/job.log" || true)"
check "two ranks train, rank 0 on node1 and rank 1 on node2" \
    "$([ "$status" = 0 ] && [ "$on_node1" = 1 ] && [ "$on_node2" = 1 ] && echo 0 || echo 1)" \
    "exit $status: $(tail -20 "$WORK/job.log")"
check "both ranks end with the same weights checksum" "$([ "$(echo "$checksums" | wc -l)" = 1 ] && [ -n "$checksums" ] && echo 0 || echo 1)" \
    "checksums: $checksums"
podman exec node1 .venv/bin/python examples/horovod_fit.py --optimizer sgd --no-shuffle --as-ranks 2 \
    --weights-out /tmp/one_process.npz >"$WORK/reference.log" 2>&1 || { tail -20 "$WORK/reference.log" >&2; }
difference="$(podman exec node1 .venv/bin/python -c '
import numpy as np
a, b = np.load("/tmp/two_nodes.npz"), np.load("/tmp/one_process.npz")
print(max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files))' 2>&1 | tail -1)"
say "largest weight difference, 2 ranks on 2 nodes vs one process on the global batches: $difference"
check "the ranks' weights equal one process on the global batches (within 1e-5)" \
    "$(python3 -c "import sys; sys.exit(0 if float('$difference') <= 1e-5 else 1)" 2>/dev/null && echo 0 || echo 1)" \
    "largest difference $difference"

# 7 (run before 6, which kills node2). A pipeline across the two containers: lms-tf launch on
# node1 starts stage 1 on node2 over ssh; both stages train a CNN (GPipe, 4 micro-batches) on
# TensorFlow's distributed runtime, bit-identically to gradient accumulation in one process.
PIPELINE=(.venv/bin/python -m lms_tf.cli launch --stages 2 --hosts node1,node2 --ssh-port 12345 --
          .venv/bin/python tests/pipeline_cluster_worker.py - sequential_cnn,gpipe,2)
say "a 2-stage pipeline across node1 and node2: ${PIPELINE[*]}"
status=0
podman exec node1 "${PIPELINE[@]}" >"$WORK/pipeline.log" 2>&1 || status=$?
result="$(grep '^RESULT ' "$WORK/pipeline.log" | tail -1)"
say "pipeline: exit $status, $result"
check "a 2-stage pipeline across two containers trains exactly as one process" \
    "$([ "$status" = 0 ] && echo "$result" | grep -q '"losses_equal": true, "trains": true, "weights_equal": true' \
       && echo "$result" | grep -q 'task:1/device:CPU:0' && echo 0 || echo 1)" \
    "exit $status: $(tail -20 "$WORK/pipeline.log")"

# 6. A node dies mid-run.
say "again, killing node2 once training has started"
podman exec node1 "${LAUNCH[@]}" --epochs 50 >"$WORK/killed.log" 2>&1 &
launcher=$!
for _ in $(seq 120); do
    grep -q "Epoch 2/" "$WORK/killed.log" 2>/dev/null && break
    sleep 1
done
podman kill node2 >/dev/null
killed_at=$SECONDS
stopped=1
for _ in $(seq "$KILL_SECONDS"); do
    if ! kill -0 "$launcher" 2>/dev/null; then stopped=0; break; fi
    sleep 1
done
status=0
if [ "$stopped" = 0 ]; then wait "$launcher" || status=$?; else kill "$launcher" 2>/dev/null || true; fi
say "the launcher stopped $((SECONDS - killed_at)) s after node2 was killed, exit $status"
check "a killed node stops the job within $KILL_SECONDS s with an error" \
    "$([ "$stopped" = 0 ] && [ "$status" != 0 ] && echo 0 || echo 1)" \
    "still running: $([ "$stopped" = 1 ] && echo yes || echo no), exit $status: $(tail -5 "$WORK/killed.log")"

echo "docker: $passed passed, $failed failed"
[ "$failed" = 0 ]
