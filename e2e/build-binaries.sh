#!/usr/bin/env bash
# Build the binaries of the e2e control plane from the Go module proxy, once, into a
# cache outside the repository keyed by the Kubernetes version:
#
#   kube-apiserver kube-controller-manager kube-scheduler kubectl   (e2e/k8s-bins/kubernetes)
#   etcd                                                            (e2e/k8s-bins/etcd)
#   kwok kwokctl                                                    (e2e/k8s-bins/kwok)
#   helm                                                            (e2e/k8s-bins/helm)
#   prometheus                                                      (e2e/k8s-bins/prometheus)
#
# Each e2e/k8s-bins/<name>/go.mod + go.sum pins the exact module versions; the build runs with
# -mod=readonly, so it never changes them. A binary is skipped when it is in the cache and its
# stamp (package, module version, go.sum hash, go version, ldflags) matches.
#
# Environment:
#   KVPILOT_CACHE_DIR  cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot)
#   GO                 the go command (default: go on PATH, else /usr/local/go/bin/go)
#   KVPILOT_BUILD_NICE nice level for the builds (default 19; the machine is shared)
#
# Progress goes to stderr; the last line on stdout is the cache bin dir.
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODS_DIR="${E2E_DIR}/k8s-bins"
CACHE_ROOT="${KVPILOT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot}"
NICE="${KVPILOT_BUILD_NICE:-19}"

log() { printf '[build-binaries] %s\n' "$*" >&2; }
die() { printf '[build-binaries] ERROR: %s\n' "$*" >&2; exit 1; }

if [[ -n "${GO:-}" ]]; then
  :
elif command -v go >/dev/null 2>&1; then
  GO="$(command -v go)"
elif [[ -x /usr/local/go/bin/go ]]; then
  GO=/usr/local/go/bin/go
else
  die "no Go toolchain found (set GO=/path/to/go)"
fi

# Version of a required module, read from a go.mod (the `require` line).
mod_version() { # <go.mod> <module path>
  local v
  v="$(awk -v m="$2" '($1 == m && $2 ~ /^v/) {print $2; exit} ($1 == "require" && $2 == m) {print $3; exit}' "$1")"
  [[ -n "$v" ]] || die "$2 is not required in $1"
  printf '%s' "$v"
}

K8S_VERSION="$(mod_version "${MODS_DIR}/kubernetes/go.mod" k8s.io/kubernetes)"
ETCD_VERSION="$(mod_version "${MODS_DIR}/etcd/go.mod" go.etcd.io/etcd/server/v3)"
KWOK_VERSION="$(mod_version "${MODS_DIR}/kwok/go.mod" sigs.k8s.io/kwok)"
HELM_VERSION="$(mod_version "${MODS_DIR}/helm/go.mod" helm.sh/helm/v3)"
PROMETHEUS_VERSION="$(mod_version "${MODS_DIR}/prometheus/go.mod" github.com/prometheus/prometheus)"

BIN_DIR="${CACHE_ROOT}/k8s/${K8S_VERSION}/bin"
STAMP_DIR="${BIN_DIR}/.stamps"
mkdir -p "${STAMP_DIR}"

# One shared Go module and build cache for all of kvpilot's builds, so warm rebuilds are fast.
export GOPATH="${CACHE_ROOT}/go"
export GOMODCACHE="${CACHE_ROOT}/go/mod"
export GOCACHE="${CACHE_ROOT}/go/build"
export GOFLAGS="-mod=readonly -buildvcs=false -trimpath"
export GOTOOLCHAIN=local
export CGO_ENABLED=0
GO_VERSION="$("${GO}" env GOVERSION)" || die "'${GO} env GOVERSION' failed"

# Serialize concurrent runs (two test sessions starting at once) on one lock.
exec 9>"${CACHE_ROOT}/k8s/.build.lock"
if ! flock -n 9; then
  log "another build holds ${CACHE_ROOT}/k8s/.build.lock; waiting for it"
  flock 9
fi

# Downloads that kwokctl might attempt if a binary were missing are pointed at a closed loopback
# port, so they fail at once instead of leaving the machine (nothing may leave 127.0.0.0/8).
OFFLINE="http://127.0.0.1:9/kvpilot-offline"
KUBE_X="-X k8s.io/component-base/version.gitVersion=${K8S_VERSION}"
KUBE_X+=" -X k8s.io/component-base/version.gitMajor=$(cut -d. -f1 <<<"${K8S_VERSION#v}")"
KUBE_X+=" -X k8s.io/component-base/version.gitMinor=$(cut -d. -f2 <<<"${K8S_VERSION}")"
KUBE_X+=" -X k8s.io/component-base/version.gitTreeState=clean"
KUBE_X+=" -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
KUBE_X+=" -X k8s.io/client-go/pkg/version.gitVersion=${K8S_VERSION}"
KUBE_X+=" -X k8s.io/client-go/pkg/version.gitMajor=$(cut -d. -f1 <<<"${K8S_VERSION#v}")"
KUBE_X+=" -X k8s.io/client-go/pkg/version.gitMinor=$(cut -d. -f2 <<<"${K8S_VERSION}")"
KWOK_X="-X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}"
KWOK_X+=" -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${K8S_VERSION#v}"
for var in BinaryPrefix KubeBinaryPrefix KubeBinaryUnofficialPrefix EtcdBinaryPrefix \
  KectlBinaryPrefix KindBinaryPrefix PrometheusBinaryPrefix JaegerBinaryPrefix \
  MetricsServerBinaryPrefix MetricsServerManifestPrefix; do
  KWOK_X+=" -X sigs.k8s.io/kwok/pkg/consts.${var}=${OFFLINE}"
done
HELM_X="-X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}"
# Prometheus' Go module v0.3XX.Y is its release 3.XX.Y.
PROMETHEUS_RELEASE="$(sed -E 's/^v0\.([0-9])([0-9]+)\.([0-9]+)$/\1.\2.\3/' <<<"${PROMETHEUS_VERSION}")"
PROMETHEUS_X="-X github.com/prometheus/common/version.Version=${PROMETHEUS_RELEASE}"
PROMETHEUS_X+=" -X github.com/prometheus/common/version.BuildDate=19700101-00:00:00"
# Only the static and file-based service discovery (the tests write their targets), no web UI
# assets (the tests use the HTTP API): 1,043 packages to compile instead of 1,517 (`go list -deps`).
PROMETHEUS_TAGS="remove_all_sd"

# name | module dir | package | module version | extra ldflags | build tags
TARGETS=(
  "etcd|etcd|go.etcd.io/etcd/server/v3|${ETCD_VERSION}|"
  "kwok|kwok|sigs.k8s.io/kwok/cmd/kwok|${KWOK_VERSION}|${KWOK_X}"
  "kwokctl|kwok|sigs.k8s.io/kwok/cmd/kwokctl|${KWOK_VERSION}|${KWOK_X}"
  "kube-apiserver|kubernetes|k8s.io/kubernetes/cmd/kube-apiserver|${K8S_VERSION}|${KUBE_X}"
  "kube-controller-manager|kubernetes|k8s.io/kubernetes/cmd/kube-controller-manager|${K8S_VERSION}|${KUBE_X}"
  "kube-scheduler|kubernetes|k8s.io/kubernetes/cmd/kube-scheduler|${K8S_VERSION}|${KUBE_X}"
  "kubectl|kubernetes|k8s.io/kubernetes/cmd/kubectl|${K8S_VERSION}|${KUBE_X}"
  "helm|helm|helm.sh/helm/v3/cmd/helm|${HELM_VERSION}|${HELM_X}"
  "prometheus|prometheus|github.com/prometheus/prometheus/cmd/prometheus|${PROMETHEUS_VERSION}|${PROMETHEUS_X}|${PROMETHEUS_TAGS}"
)

log "Kubernetes ${K8S_VERSION}, etcd ${ETCD_VERSION}, kwok ${KWOK_VERSION}, helm ${HELM_VERSION}, prometheus ${PROMETHEUS_VERSION}; ${GO_VERSION}"
log "cache: ${BIN_DIR} (Go caches under ${GOPATH})"
TIMES_FILE="${BIN_DIR}/../build-times.txt"
total_start=$SECONDS
built=0
for target in "${TARGETS[@]}"; do
  IFS='|' read -r name moddir pkg version xflags tags <<<"${target}"
  dir="${MODS_DIR}/${moddir}"
  [[ -f "${dir}/go.sum" ]] || die "${dir}/go.sum is missing (run 'go mod tidy' in ${dir})"
  ldflags="-s -w ${xflags}"
  stamp="${pkg}@${version} gosum=$(sha256sum "${dir}/go.sum" | cut -c1-16) ${GO_VERSION} ldflags=$(sha256sum <<<"${ldflags}" | cut -c1-16)"
  tag_args=()
  if [[ -n "${tags}" ]]; then
    # Only where there are tags, so that the stamps of the other binaries stay as they were.
    stamp+=" tags=${tags}"
    tag_args=(-tags "${tags}")
  fi
  if [[ -x "${BIN_DIR}/${name}" && -f "${STAMP_DIR}/${name}" && "$(cat "${STAMP_DIR}/${name}")" == "${stamp}" ]]; then
    log "cached  ${name} (${pkg}@${version})"
    continue
  fi
  log "build   ${name} (${pkg}@${version}) ..."
  start=$SECONDS
  tmp="${BIN_DIR}/.${name}.tmp.$$"
  cmd=(nice -n "${NICE}" "${GO}" build "${tag_args[@]}" -ldflags "${ldflags}" -o "${tmp}" "${pkg}")
  if ! (cd "${dir}" && "${cmd[@]}"); then
    rm -f "${tmp}"
    printf -v cmd_str '%q ' "${cmd[@]}"
    die "building ${name} failed (the go command's error is above). To reproduce:
  cd ${dir} && GOPATH=${GOPATH} GOMODCACHE=${GOMODCACHE} GOCACHE=${GOCACHE} GOFLAGS='${GOFLAGS}' GOTOOLCHAIN=local CGO_ENABLED=0 ${cmd_str}"
  fi
  mv -f "${tmp}" "${BIN_DIR}/${name}"
  printf '%s\n' "${stamp}" >"${STAMP_DIR}/${name}"
  secs=$((SECONDS - start))
  built=$((built + 1))
  log "built   ${name} in ${secs}s"
  printf '%s %s %ss %s\n' "$(date -u +%FT%TZ)" "${name}" "${secs}" "${stamp}" >>"${TIMES_FILE}"
done
log "done: ${built} built, $(( ${#TARGETS[@]} - built )) cached, ${SECONDS}s total ($((SECONDS - total_start))s building)"
printf '%s\n' "${BIN_DIR}"
