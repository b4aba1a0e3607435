#!/usr/bin/env bash
# Builds helm (the Kubernetes tests render deploy/helm/ballast with it) from the Go module
# proxy (no binary download site is needed) into
# ${BALLAST_CACHE_DIR:-$HOME/.cache/ballast}/helm-v4.3.2/bin/helm.
#
# Warm path (the stamp file exists): prints the bin dir and exits at once; this runs at
# every `make test`. Cold path: a few minutes on 2 cores (`go install`; the Go module
# and build caches are shared with the control plane's build). The build goes into a
# temporary folder next to the cache and is renamed into place only when it succeeded;
# concurrent runs serialise on a lock file (scripts/k8s/go-cache.sh).
#
# stdout: the bin dir (one line). Progress and errors: stderr.
# Env: BALLAST_CACHE_DIR, GO (go binary), GOMODCACHE/GOCACHE (Go's own).
set -euo pipefail

HELM_VERSION=v4.3.2
NAME=helm GO_MIN_MINOR=26
CACHE="${BALLAST_CACHE_DIR:-$HOME/.cache/ballast}/helm-$HELM_VERSION"
OUT="$CACHE/bin"
warm() { [ -f "$CACHE/stamp" ] && [ -x "$CACHE/bin/helm" ]; }
. "$(dirname "$0")/go-cache.sh"
go_cache_begin

log "cold build of helm $HELM_VERSION into $CACHE (a few minutes)"
mkdir -p "$TMP/bin"
GOBIN="$TMP/bin" "$GO" install -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
  "helm.sh/helm/v4/cmd/helm@$HELM_VERSION" >&2 || die "go install helm.sh/helm/v4/cmd/helm@$HELM_VERSION failed"
"$TMP/bin/helm" version >&2 || die "the helm built does not run"
touch "$TMP/stamp"
go_cache_commit
