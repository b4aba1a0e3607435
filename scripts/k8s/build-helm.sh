#!/usr/bin/env bash
# Builds helm (the Kubernetes tests render deploy/helm/ballast with it) from the Go module
# proxy (no binary download site is needed) into
# ${BALLAST_CACHE_DIR:-$HOME/.cache/ballast}/helm-v4.3.2/bin/helm.
#
# Warm path (the stamp file exists): prints the bin dir and exits at once; this runs at
# every `make test`. Cold path: a few minutes on 2 cores (`go install`; the Go module
# and build caches are shared with the control plane's build). The build goes into a
# temporary folder next to the cache and is renamed into place only when it succeeded;
# concurrent runs serialise on a lock file.
#
# stdout: the bin dir (one line). Progress and errors: stderr.
# Env: BALLAST_CACHE_DIR, GO (go binary), GOMODCACHE/GOCACHE (Go's own).
set -euo pipefail

HELM_VERSION=v4.3.2
CACHE_ROOT="${BALLAST_CACHE_DIR:-$HOME/.cache/ballast}"
CACHE="$CACHE_ROOT/helm-$HELM_VERSION"
STAMP="$CACHE/stamp"

warm() { [ -f "$STAMP" ] && [ -x "$CACHE/bin/helm" ]; }
if warm; then
  echo "$CACHE/bin"
  exit 0
fi

log() { echo "ballast helm: $*" >&2; }
die() { echo "ballast helm: ERROR: $*" >&2; exit 1; }

mkdir -p "$CACHE_ROOT" || die "cannot create $CACHE_ROOT"
exec 9>"$CACHE_ROOT/.helm-build.lock"
if ! flock -n 9; then
  log "another build of $CACHE is running; waiting for it..."
  flock 9
fi
if warm; then
  echo "$CACHE/bin"
  exit 0
fi

GO="${GO:-}"
if [ -z "$GO" ]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [ -x /usr/local/go/bin/go ]; then GO=/usr/local/go/bin/go
  else die "no Go toolchain: install Go >= 1.26 (https://go.dev/dl/) or set GO=/path/to/go"; fi
fi
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-buildvcs=false"
export GOPROXY="${GOPROXY:-https://proxy.golang.org,direct}"

rm -rf "$CACHE_ROOT"/.tmp-helm-build.*
TMP="$(mktemp -d "$CACHE_ROOT/.tmp-helm-build.XXXXXX")"
chmod 755 "$TMP"
trap 'rm -rf "$TMP"' EXIT
T0=$SECONDS
log "cold build of helm $HELM_VERSION into $CACHE (a few minutes)"
mkdir -p "$TMP/bin"
GOBIN="$TMP/bin" "$GO" install -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
  "helm.sh/helm/v4/cmd/helm@$HELM_VERSION" >&2 || die "go install helm.sh/helm/v4/cmd/helm@$HELM_VERSION failed"
"$TMP/bin/helm" version >&2 || die "the helm built does not run"
touch "$TMP/stamp"
rm -rf "$CACHE"
mv "$TMP" "$CACHE"
trap - EXIT
log "built in $((SECONDS - T0)) s"
echo "$CACHE/bin"
