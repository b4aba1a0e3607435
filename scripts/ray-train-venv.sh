#!/usr/bin/env bash
# Builds (once) the venv bench/ray_bench.py runs Ray Train's side in: Debian's
# /usr/bin/python3 with its site-packages (torch 1.13, NumPy 1.24), Ray from
# the cached Ray venv (scripts/ray-venv.sh) through a .pth, and ray[train]'s
# extras from PyPI, pinned below (pyarrow < 21 and pandas < 3: newer ones need
# NumPy 2). Cached under a versioned name; `make ray-train` runs it. Prints
# the venv's python on stdout; progress goes to stderr.
#
#   scripts/ray-train-venv.sh          -> ~/.cache/ballast/raytrain-2.60.0-py3.11/bin/python
set -euo pipefail
EXTRAS=(pandas==2.3.3 pyarrow==20.0.0 fsspec==2026.9.0 tensorboardX==2.6.5)
PY=/usr/bin/python3
here=$(cd "$(dirname "$0")" && pwd)
ray_python=$("$here/ray-venv.sh")
ray_version=$("$ray_python" -c 'import ray; print(ray.__version__)')
ray_site=$("$ray_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cache=${BALLAST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ballast}
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
venv="$cache/raytrain-$ray_version-py$pyver"
[ $# -eq 0 ] || { echo "ray-train-venv.sh: unknown argument '$1'" >&2; exit 2; }
if [ -f "$venv/.ballast-ready" ]; then echo "$venv/bin/python"; exit 0; fi
echo "ballast: building the Ray Train venv in $venv (once; ~1 min)" >&2
rm -rf "$venv"
mkdir -p "$cache"
"$PY" -m venv --system-site-packages "$venv" >&2
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ray_site" > "$site/ballast-ray.pth"
numpy=$("$PY" -c 'import numpy; print(numpy.__version__)')
echo "numpy==$numpy" > "$venv/constraints.txt"
"$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -c "$venv/constraints.txt" \
  "${EXTRAS[@]}" >&2 || { echo "ballast: pip could not install ${EXTRAS[*]} into $venv (network?)" >&2; exit 1; }
"$venv/bin/python" -c "import ray.train.torch, pandas, pyarrow; print('ballast: Ray Train', __import__('ray').__version__, 'ready')" >&2
touch "$venv/.ballast-ready"
echo "$venv/bin/python"
