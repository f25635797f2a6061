#!/usr/bin/env bash
# Fill the test suite's slow caches, side by side: the control plane, kwok, helm and prometheus built
# from the Go module proxy (e2e/build-binaries.sh, ~22 min cold on 2 cores) and the venv of vLLM's
# own config code (tests/vllm/env.py, a few minutes of downloads cold). Each returns in seconds when
# its cache is full.
#
# `make test` starts this in the background beside the unit tests, which need neither: on a cold
# machine the builds run in the time the single-threaded tests leave a core idle (the Go builds at
# nice 19, so they take only what the tests leave) instead of after them. The tests that need a
# cache take the same lock its builder holds (build-binaries.sh's flock, env.py's fcntl lock), so
# they wait for the build in flight rather than start another, and a build that failed here is run
# again there, where its error fails the test that needs it.
#
# Usage: e2e/warm-caches.sh PYTHON   (the project venv's python); progress and errors on stderr.
set -uo pipefail

# `make test` starts this in a session of its own (setsid, so that it can stop the whole group), and
# with autogroup scheduling (Linux's default) a session is a scheduling group weighed against the
# tests' as an equal before any nice value inside it counts: the builds would take a core from the
# tests, and two torch threads beside a busy process run ~3x slower. The group's own nice level
# (/proc/self/autogroup) puts the whole group behind the tests.
echo 19 >/proc/self/autogroup 2>/dev/null || true

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${1:?usage: $0 PYTHON}"

bash "${REPO}/e2e/build-binaries.sh" >/dev/null &
go_build=$!
(cd "${REPO}" && "${PYTHON}" -c 'from tests.vllm.env import vllm_python; vllm_python()') &
vllm_env=$!

status=0
wait "${go_build}" || { echo "[warm-caches] build-binaries.sh failed; the e2e tests run it again" >&2; status=1; }
wait "${vllm_env}" || { echo "[warm-caches] the vLLM venv failed; its tests build it again" >&2; status=1; }
exit "${status}"
