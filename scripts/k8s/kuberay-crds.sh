#!/usr/bin/env bash
# KubeRay's CustomResourceDefinitions (RayJob, RayCluster) of one release, from
# the Go module proxy (the ray-operator module carries its config/crd/bases),
# for kubernetes.test_kuberay: the API server validates
# examples/ray/rayjob.yaml against them. Nothing is built. Cached in
#   ${BALLAST_CACHE_DIR:-$HOME/.cache/ballast}/kuberay-crds-v1.5.0/
#     crds/ray.io_rayjobs.yaml, crds/ray.io_rayclusters.yaml
#
# Warm path (the stamp exists): prints the cache dir and exits at once. Cold
# path: one `go mod download` (a few MB, seconds).
#
# stdout: the cache dir (one line). Progress and errors: stderr.
# Env: BALLAST_CACHE_DIR, GO (go binary), GOMODCACHE (Go's own).
set -euo pipefail

KUBERAY_VERSION=v1.5.0
MODULE=github.com/ray-project/kuberay/ray-operator
NAME=kuberay-crds GO_MIN_MINOR=21
CACHE="${BALLAST_CACHE_DIR:-$HOME/.cache/ballast}/kuberay-crds-$KUBERAY_VERSION"
OUT="$CACHE"
warm() { [ -f "$CACHE/stamp" ] && [ -f "$CACHE/crds/ray.io_rayjobs.yaml" ] && [ -f "$CACHE/crds/ray.io_rayclusters.yaml" ]; }
. "$(dirname "$0")/go-cache.sh"
go_cache_begin

log "downloading $MODULE@$KUBERAY_VERSION from the Go module proxy"
json="$("$GO" mod download -json "$MODULE@$KUBERAY_VERSION")" ||
  die "go mod download $MODULE@$KUBERAY_VERSION failed (is $GOPROXY reachable?)"
src="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' <<<"$json" | head -n1)"
mkdir -p "$TMP/crds"
for crd in ray.io_rayjobs.yaml ray.io_rayclusters.yaml; do
  [ -f "$src/config/crd/bases/$crd" ] || die "no config/crd/bases/$crd in the module ($src)"
  cp "$src/config/crd/bases/$crd" "$TMP/crds/"
done
chmod -R u+w "$TMP"
echo "$MODULE $KUBERAY_VERSION CRDs fetched $(date -u +%FT%TZ) with $GOVER" >"$TMP/stamp"
go_cache_commit
