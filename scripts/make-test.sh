#!/usr/bin/env bash
# `make test`: everything the tests need, then ctest, in the order that keeps a
# fresh machine's run short.
#
#   scripts/make-test.sh BUILD_DIR JOBS [ctest args...]
#
# On a fresh machine the Go builds of the Kubernetes control plane, helm and
# Kueue (`make k8s-binaries`: ~20 core-minutes) are the largest part of the
# setup, and only the Kubernetes tests need them; the suites that run one at a
# time (RUN_SERIAL: real training jobs, label `serial`) leave about half of the
# cores idle. So:
#   1. the Go builds start at once in the background at idle CPU priority
#      (SCHED_IDLE: they take only cycles nothing else wants; log:
#      BUILD_DIR/go-builds.log); warm caches make them instant;
#   2. the rest of the setup (`make test-prep`: Debian packages, the C++ build,
#      the torch 2.x and Ray venvs, the wheels) in the foreground;
#   3. ctest of the `serial` tests, the Go builds going on beside them;
#   4. once the Go builds are done, ctest of everything else (the unit tests,
#      the Slurm and Kubernetes suites, side by side).
# Both ctest runs always run; the exit status is non-zero if anything failed.
# Interrupted (Ctrl-C, SIGTERM), the background builds are stopped too (the
# build scripts leave no half cache: scripts/k8s/go-cache.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:?usage: make-test.sh BUILD_DIR JOBS [ctest args...]}
JOBS=${2:?usage: make-test.sh BUILD_DIR JOBS [ctest args...]}
shift 2

say() { echo "ballast make test: $*" >&2; }

mkdir -p "$BUILD_DIR" || exit 1
GO_LOG="$BUILD_DIR/go-builds.log"
GO_PID=
stop_go() {
  if [ -n "$GO_PID" ] && kill -0 "$GO_PID" 2>/dev/null; then
    kill -TERM -- "-$GO_PID" 2>/dev/null
    wait "$GO_PID" 2>/dev/null
  fi
  GO_PID=
}
trap 'stop_go' EXIT
trap 'say "interrupted"; stop_go; exit 130' INT TERM HUP

# 1. The Go builds, in a session of their own (so that stop_go reaches the go
#    commands under make), at idle priority. With the kernel's autogroups (the
#    default), a new session is a scheduling group that gets its fair share
#    whatever its tasks' policy: so the group's own nice goes to 19 too.
idle=(nice -n 19)
if chrt --idle 0 true 2>/dev/null; then idle=(chrt --idle 0 nice -n 19); fi
# (Set from inside the new session: written from here, it could reach this
# script's group before the child's setsid.)
setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null; exec "$@"' make-test-go \
  "${idle[@]}" make --no-print-directory k8s-binaries >"$GO_LOG" 2>&1 &
GO_PID=$!

# 2. The rest of the setup.
if ! make --no-print-directory test-prep; then
  say "the setup failed (see above)"
  exit 1
fi

ctest_run() {  # WHAT ctest-args...
  local what=$1
  shift
  say "ctest: $what"
  (cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS" "$@")
}

# 3. The tests that run one at a time.
failed=()
ctest_run "the suites that run one at a time (label serial)" -L serial "$@" || failed+=("the serial suites")

# 4. The Go builds, then everything else.
if kill -0 "$GO_PID" 2>/dev/null; then
  say "waiting for the Go builds of the Kubernetes control plane, helm and Kueue (log: $GO_LOG)..."
  t0=$SECONDS
  while kill -0 "$GO_PID" 2>/dev/null; do
    sleep 5
    if (((SECONDS - t0) % 60 < 5)); then say "still building ($((SECONDS - t0)) s): $(tail -n1 "$GO_LOG")"; fi
  done
fi
wait "$GO_PID"
go_rc=$?
GO_PID=
if [ "$go_rc" -ne 0 ]; then
  say "the Go builds failed (exit $go_rc); the Kubernetes tests will fail too. The end of $GO_LOG:"
  tail -n 30 "$GO_LOG" >&2
  failed+=("the Go builds")
fi
ctest_run "the unit tests, the Slurm and Kubernetes suites" -LE serial "$@" || failed+=("the other tests")

if [ ${#failed[@]} -gt 0 ]; then
  say "FAILED: ${failed[*]} (see above)"
  exit 1
fi
say "all passed"
