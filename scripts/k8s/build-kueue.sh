#!/usr/bin/env bash
# Builds the Kueue controller manager the Kueue tests run against, from the Go
# module proxy (no binary download site is needed), with the CRDs and webhook
# manifests of the same release, into
#   ${BALLAST_CACHE_DIR:-$HOME/.cache/ballast}/kueue-v0.17.0/
#     bin/kueue                 (sigs.k8s.io/kueue/cmd/kueue)
#     crds/*.yaml               (config/components/crd/bases)
#     webhook/manifests.yaml    (config/components/webhook)
#
# Warm path (the stamp file exists): prints the cache dir and exits at once;
# this runs at every `make test`. Cold path: ~3-6 min on 2 cores (module
# downloads, then one Go build); the build goes into a temporary folder next to
# the cache and is renamed into place only when it is complete; concurrent runs
# serialise on a lock file.
#
# stdout: the cache dir (one line). Progress and errors: stderr.
# Env: BALLAST_CACHE_DIR, GO (go binary), GOMODCACHE/GOCACHE (Go's own).
set -euo pipefail

KUEUE_VERSION=v0.17.0
CACHE_ROOT="${BALLAST_CACHE_DIR:-$HOME/.cache/ballast}"
CACHE="$CACHE_ROOT/kueue-$KUEUE_VERSION"
STAMP="$CACHE/stamp"

warm() { [ -f "$STAMP" ] && [ -x "$CACHE/bin/kueue" ] && [ -f "$CACHE/webhook/manifests.yaml" ]; }
if warm; then
  echo "$CACHE"
  exit 0
fi

log() { echo "ballast kueue: $*" >&2; }
die() { echo "ballast kueue: ERROR: $*" >&2; exit 1; }

mkdir -p "$CACHE_ROOT" || die "cannot create $CACHE_ROOT"
exec 9>"$CACHE_ROOT/.kueue-build.lock"
if ! flock -n 9; then
  log "another build of $CACHE is running; waiting for it..."
  flock 9
fi
if warm; then
  echo "$CACHE"
  exit 0
fi

GO="${GO:-}"
if [ -z "$GO" ]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [ -x /usr/local/go/bin/go ]; then GO=/usr/local/go/bin/go
  else die "no Go toolchain: install Go >= 1.25 (https://go.dev/dl/) or set GO=/path/to/go"; fi
fi
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-buildvcs=false"
export GOPROXY="${GOPROXY:-https://proxy.golang.org,direct}"
gover="$("$GO" env GOVERSION)" || die "$GO does not run"
case "$gover" in
  go1.2[5-9]*|go1.[3-9][0-9]*) ;;
  *) die "$GO is $gover; Kueue $KUEUE_VERSION needs Go >= 1.25" ;;
esac

rm -rf "$CACHE_ROOT"/.tmp-kueue-build.*
TMP="$(mktemp -d "$CACHE_ROOT/.tmp-kueue-build.XXXXXX")"
chmod 755 "$TMP"
trap 'rm -rf "$TMP"' EXIT
T0=$SECONDS
log "cold build of $CACHE (Go: $gover)"

log "downloading sigs.k8s.io/kueue@$KUEUE_VERSION"
json="$("$GO" mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION")" ||
  die "go mod download sigs.k8s.io/kueue@$KUEUE_VERSION failed (is $GOPROXY reachable?)"
src="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' <<<"$json" | head -n1)"
[ -d "$src/cmd/kueue" ] || die "no cmd/kueue in the module ($src)"
grep -qE '^[[:space:]]*replace[[:space:]]' "$src/go.mod" &&
  die "sigs.k8s.io/kueue@$KUEUE_VERSION's go.mod has replace directives; build it from a wrapper module"

mkdir -p "$TMP/out/bin" "$TMP/out/crds" "$TMP/out/webhook"
log "building cmd/kueue (a few minutes on 2 cores)"
# `go install pkg@version` builds with the release's own go.mod and go.sum.
GOBIN="$TMP/out/bin" "$GO" install -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
  "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION" >&2 || die "go install sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION failed"
cp "$src"/config/components/crd/bases/*.yaml "$TMP/out/crds/"
cp "$src/config/components/webhook/manifests.yaml" "$TMP/out/webhook/"
chmod -R u+w "$TMP/out"
"$TMP/out/bin/kueue" --help >/dev/null 2>&1 || true
echo "sigs.k8s.io/kueue $KUEUE_VERSION built $(date -u +%FT%TZ) with $gover" >"$TMP/out/stamp"
rm -rf "$CACHE"
mv "$TMP/out" "$CACHE"
log "built $CACHE in $((SECONDS - T0)) s"
echo "$CACHE"
