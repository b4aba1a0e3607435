# Sourced by scripts/k8s/build-*.sh: what every pinned Go build into
# ${BALLAST_CACHE_DIR:-$HOME/.cache/ballast}/<name>-<version> shares.
#
#   NAME=helm CACHE=... GO_MIN_MINOR=26 OUT="$CACHE/bin"; warm() { ...; }
#   . scripts/k8s/go-cache.sh
#   go_cache_begin          # warm: prints $OUT and exits 0. Else: the lock (a concurrent
#                           # build is waited for), $GO found and checked, the Go env
#                           # exported, an empty $TMP next to the cache (removed on exit)
#   ... build into $TMP ...
#   go_cache_commit         # $TMP becomes $CACHE (never a half cache), prints $OUT
#
# log/die print with the prefix "ballast $NAME:".

log() { echo "ballast $NAME: $*" >&2; }
die() { echo "ballast $NAME: ERROR: $*" >&2; exit 1; }

CACHE_ROOT="${BALLAST_CACHE_DIR:-$HOME/.cache/ballast}"

go_cache_begin() {
  if warm; then
    echo "$OUT"
    exit 0
  fi
  mkdir -p "$CACHE_ROOT" || die "cannot create $CACHE_ROOT"
  exec 9>"$CACHE_ROOT/.$NAME-build.lock"
  if ! flock -n 9; then
    log "another build of $CACHE is running; waiting for it..."
    flock 9
  fi
  if warm; then  # built by the run we waited for
    echo "$OUT"
    exit 0
  fi
  GO="${GO:-}"
  if [ -z "$GO" ]; then
    if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
    elif [ -x /usr/local/go/bin/go ]; then GO=/usr/local/go/bin/go
    else die "no Go toolchain: install Go >= 1.$GO_MIN_MINOR (https://go.dev/dl/) or set GO=/path/to/go"; fi
  fi
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="${GOFLAGS_EXTRA:-} -buildvcs=false"
  export GOPROXY="${GOPROXY:-https://proxy.golang.org,direct}"
  GOVER="$("$GO" env GOVERSION)" || die "$GO does not run"
  local minor
  minor="$(sed -n -E 's/^go1\.([0-9]+).*$/\1/p' <<<"$GOVER")"
  [ -n "$minor" ] && [ "$minor" -ge "$GO_MIN_MINOR" ] || die "$GO is $GOVER; $NAME needs Go >= 1.$GO_MIN_MINOR"
  rm -rf "$CACHE_ROOT"/.tmp-"$NAME"-build.*  # left by an interrupted build (we hold the lock)
  TMP="$(mktemp -d "$CACHE_ROOT/.tmp-$NAME-build.XXXXXX")"
  chmod 755 "$TMP"
  trap 'rm -rf "$TMP"' EXIT
  T0=$SECONDS
}

go_cache_commit() {
  rm -rf "$CACHE"
  mv -T "$TMP" "$CACHE" || die "cannot move $TMP to $CACHE"
  trap - EXIT
  log "built $CACHE in $((SECONDS - T0)) s"
  echo "$OUT"
}
