#!/usr/bin/env bash
# Builds (once) the Ray runtime Ballast's Ray backend is tested with: PyPI's
# ray[default] pinned below, in a venv of Debian's /usr/bin/python3, cached
# under a versioned name so a machine reinstalls only when the pin changes.
# The test venvs (scripts/ray-wheel-venv.sh) take it through a .pth, beside
# either torch. Prints the venv's python on stdout; progress goes to stderr.
#
#   scripts/ray-venv.sh          -> ~/.cache/ballast/ray-2.60.0-py3.11/bin/python
#   scripts/ray-venv.sh --path   prints that path, builds nothing
set -euo pipefail
RAY_VERSION=2.60.0
PY=/usr/bin/python3
cache=${BALLAST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ballast}
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
venv="$cache/ray-$RAY_VERSION-py$pyver"
if [ "${1:-}" = "--path" ]; then echo "$venv/bin/python"; exit 0; fi
[ $# -eq 0 ] || { echo "ray-venv.sh: unknown argument '$1'" >&2; exit 2; }
if [ -f "$venv/.ballast-ready" ]; then echo "$venv/bin/python"; exit 0; fi
echo "ballast: building the Ray $RAY_VERSION venv in $venv (once; ~45 s)" >&2
rm -rf "$venv"
mkdir -p "$cache"
"$PY" -m venv "$venv" >&2
"$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off "ray[default]==$RAY_VERSION" >&2 || {
  echo "ballast: pip could not install ray[default]==$RAY_VERSION into $venv (network?)" >&2; exit 1; }
"$venv/bin/python" -c "import ray; print('ballast: ray', ray.__version__, 'ready')" >&2
touch "$venv/.ballast-ready"
echo "$venv/bin/python"
