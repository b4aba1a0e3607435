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
# this runs at every `make test`. Cold path: one `go install` with the release's
# own go.sum: ~9 min on 2 busy cores with an empty GOCACHE (module downloads
# extra; ~1.9 GB of GOCACHE), ~15 s when GOCACHE already holds it; the build
# goes into a temporary folder next to the cache and is renamed into place only
# when it is complete; concurrent runs serialise on a lock file
# (scripts/k8s/go-cache.sh).
#
# stdout: the cache dir (one line). Progress and errors: stderr.
# Env: BALLAST_CACHE_DIR, GO (go binary), GOMODCACHE/GOCACHE (Go's own).
set -euo pipefail

KUEUE_VERSION=v0.17.0
NAME=kueue GO_MIN_MINOR=25
CACHE="${BALLAST_CACHE_DIR:-$HOME/.cache/ballast}/kueue-$KUEUE_VERSION"
OUT="$CACHE"
warm() { [ -f "$CACHE/stamp" ] && [ -x "$CACHE/bin/kueue" ] && [ -f "$CACHE/webhook/manifests.yaml" ]; }
. "$(dirname "$0")/go-cache.sh"
go_cache_begin

log "cold build of $CACHE (Go: $GOVER); downloading sigs.k8s.io/kueue@$KUEUE_VERSION"
json="$("$GO" mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION")" ||
  die "go mod download sigs.k8s.io/kueue@$KUEUE_VERSION failed (is $GOPROXY reachable?)"
src="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' <<<"$json" | head -n1)"
[ -d "$src/cmd/kueue" ] || die "no cmd/kueue in the module ($src)"
# The release's date (the proxy's .info "Time") as the build date: reproducible.
info="$(sed -n 's/^[[:space:]]*"Info": "\(.*\)",\{0,1\}$/\1/p' <<<"$json" | head -n1)"
reldate="$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$info" 2>/dev/null || true)"
mkdir -p "$TMP/bin" "$TMP/crds" "$TMP/webhook"
log "building cmd/kueue (minutes on 2 cores)"
# `go install pkg@version` builds with the release's own go.mod and go.sum (no
# replace directives there, so no wrapper module is needed). Version stamps as
# Kueue's Makefile sets them (LD_FLAGS: GitVersion, GitCommit, BuildDate); the
# module proxy knows no commit, so GitCommit says where the source came from.
VPKG=sigs.k8s.io/kueue/pkg/version
GOBIN="$TMP/bin" "$GO" install -trimpath \
  -ldflags "-s -w -X $VPKG.GitVersion=$KUEUE_VERSION -X $VPKG.GitCommit=$KUEUE_VERSION-goproxy -X $VPKG.BuildDate=${reldate:-unknown}" \
  "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION" >&2 || die "go install sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION failed"
[ -x "$TMP/bin/kueue" ] || die "go install produced no $TMP/bin/kueue"
# Kueue has no --version flag: check the module recorded in the binary, and that it runs.
# (Outputs captured first: `| grep -q` could SIGPIPE the writer under pipefail.)
v="$("$GO" version -m "$TMP/bin/kueue" 2>&1)" || die "go version -m bin/kueue failed: $v"
grep -qE "^[[:space:]]+mod[[:space:]]+sigs\.k8s\.io/kueue[[:space:]]+$KUEUE_VERSION([[:space:]]|\$)" <<<"$v" ||
  die "bin/kueue is not built from sigs.k8s.io/kueue $KUEUE_VERSION: $(head -n3 <<<"$v")"
v="$("$TMP/bin/kueue" --help 2>&1)" || die "bin/kueue --help failed: $(tail -n5 <<<"$v")"
grep -q -- '-config string' <<<"$v" || die "bin/kueue --help lists no -config flag"
ls "$src"/config/components/crd/bases/*.yaml >/dev/null 2>&1 || die "no CRDs in $src/config/components/crd/bases"
cp "$src"/config/components/crd/bases/*.yaml "$TMP/crds/"
cp "$src/config/components/webhook/manifests.yaml" "$TMP/webhook/"
chmod -R u+w "$TMP"
echo "sigs.k8s.io/kueue $KUEUE_VERSION built $(date -u +%FT%TZ) with $GOVER" >"$TMP/stamp"
go_cache_commit
