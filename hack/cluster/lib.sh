# shellcheck shell=bash disable=SC2034 # variables are for the scripts that source this
# Shared settings and helpers for hack/cluster/{up,down} and hack/image/*.
# Sourced, never executed. Callers set -euo pipefail themselves.

UNDERSTUDY_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# --- pinned versions ---------------------------------------------------------
# k8s.io/kubernetes: newest v1.36.x the module proxy serves *and* the checksum
# database verifies (v1.36.5 is listed by the proxy but sum.golang.org has no
# record of it, so `go mod download` refuses it). Keep in step with
# hack/tools/k8s/go.mod.
KUBE_VERSION="v1.36.4"
HELM_VERSION="v3.21.4"
# containerd from the Go module proxy, not Debian's 1.6: DRA hands devices to
# containers through CDI, which containerd supports from 1.7 (on by default in
# 2.x). 2.2 is the last line with cgroup v1 support guaranteed (this host is
# hybrid v1/v2). runc itself comes from Debian.
CONTAINERD_VERSION="v2.2.9"
# build/pause/Makefile TAG in the pinned kubernetes module.
PAUSE_VERSION="3.10.2"

# --- locations ----------------------------------------------------------------
UNDERSTUDY_CACHE="${UNDERSTUDY_CACHE:-/var/cache/understudy}"
UNDERSTUDY_CLUSTER_DIR="${UNDERSTUDY_CLUSTER_DIR:-/var/lib/understudy/cluster}"
K8S_CACHE="$UNDERSTUDY_CACHE/k8s/$KUBE_VERSION"
K8S_BIN="$K8S_CACHE/bin"
HELM_BIN="$UNDERSTUDY_CACHE/helm/$HELM_VERSION/bin"
CONTAINERD_BIN="$UNDERSTUDY_CACHE/containerd/$CONTAINERD_VERSION/bin"
GO_BIN="${GO_BIN:-/usr/local/go/bin/go}"

D="$UNDERSTUDY_CLUSTER_DIR"
PIDS_FILE="$D/pids"
CONTAINERD_SOCK="$D/containerd/containerd.sock"
KUBELET_DIR="$D/kubelet"
CDI_DIR="$D/cdi"

# --- cluster shape ------------------------------------------------------------
# The node's address is the gateway of a bridge we create: local to this
# machine, reachable from pods and the host alike.
NODE_NAME="understudy-node"
BRIDGE="understudy0"
POD_CIDR="10.244.0.0/24"
NODE_IP="10.244.0.1"
SERVICE_CIDR="10.96.0.0/16"
KUBERNETES_SVC_IP="10.96.0.1"
APISERVER_PORT=6443
ETCD_CLIENT_URL="http://127.0.0.1:23790"
ETCD_PEER_URL="http://127.0.0.1:23800"

DRA_DRIVER="gpu.understudy.dev"
DEVICE_CLASS="gpu.understudy.dev"
FAKE_GPUS="${UNDERSTUDY_FAKE_GPUS:-4}"

PAUSE_IMAGE="localhost/understudy-pause:$PAUSE_VERSION"
BASE_IMAGE="localhost/understudy-base:bookworm"
APP_IMAGE="localhost/understudy:dev"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Run a command with the cached binaries first on PATH.
k8s_path() { printf '%s:%s:%s:%s' "$K8S_BIN" "$HELM_BIN" "$CONTAINERD_BIN" "$PATH"; }

kubectl_admin() { "$K8S_BIN/kubectl" --kubeconfig "$D/admin.kubeconfig" "$@"; }

# Our ctr when it is built, else any on PATH (down on a machine without the cache).
ctr_bin() { if [[ -x "$CONTAINERD_BIN/ctr" ]]; then echo "$CONTAINERD_BIN/ctr"; else command -v ctr || echo ctr; fi; }
ctr_k8s() { "$(ctr_bin)" --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }
# ctr_k8s_t SECONDS ARGS...: the same, bounded in time.
ctr_k8s_t() { timeout "$1" "$(ctr_bin)" --address "$CONTAINERD_SOCK" --namespace k8s.io "${@:2}"; }
# ctr_import TAR: import an image archive into the cluster's containerd (k8s.io).
ctr_import() {
    ctr_k8s images import "$1" 2> >(grep -v 'support for cgroup v1 is deprecated' >&2) >/dev/null
}
ctr_up() { [[ -S "$CONTAINERD_SOCK" ]] && timeout 5 "$(ctr_bin)" --address "$CONTAINERD_SOCK" version >/dev/null 2>&1; }

# wait_for SECONDS DESCRIPTION CMD...: poll CMD every 0.5 s until it succeeds.
wait_for() {
    local timeout="$1" what="$2"; shift 2
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            log "timed out after ${timeout}s waiting for $what"
            return 1
        fi
        sleep 0.5
    done
}

# Is the process recorded as NAME in the pids file alive and still ours?
pid_alive() {
    local pid="$1" exe="$2"
    [[ -d /proc/$pid ]] || return 1
    # Guard against PID reuse: the command line must still name the binary.
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$exe"
}
