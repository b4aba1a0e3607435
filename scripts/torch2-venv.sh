#!/usr/bin/env bash
# Builds (once) the torch 2.x runtime Ballast is tested with: a venv of
# Debian's /usr/bin/python3 with PyPI's torch pinned below, cached under a
# versioned name so a machine reinstalls only when the pin changes. Prints the
# venv's python on stdout; progress goes to stderr.
#
#   scripts/torch2-venv.sh            -> ~/.cache/ballast/torch-2.15.0-py3.11/bin/python
#   scripts/torch2-venv.sh --path     prints that path, builds nothing (CMake's
#                                     configure step: the tests' BALLAST_TORCH2_PYTHON)
#   scripts/torch2-venv.sh --python 3.12 [--path]
#       the same torch for another CPython (pyenv's $PYENV_ROOT/versions/3.12.*;
#       nothing downloads an interpreter): ~/.cache/ballast/torch-2.15.0-py3.12,
#       where the wheel tests install Ballast's wheel. Its CUDA libraries
#       (nvidia-*, 3 GB, the same files for every Python) are the first venv's,
#       a link in its site-packages: torch runs on CPU there, as the tests do.
#
# The default torch wheel brings the CUDA runtime libraries (~5 GB installed,
# minutes to download); it runs on CPU with gloo, as the tests do.
#
# Hugging Face transformers and accelerate (the Trainer integration's tests)
# are a second layer with its own stamp: a change of their pins reinstalls
# them, not torch. (transformers 5.23+ needs a `kernels` release PyPI does not
# serve here.)
set -euo pipefail
TORCH_VERSION=2.15.0
NUMPY_VERSION=2.4.6
TRANSFORMERS_VERSION=5.22.2
ACCELERATE_VERSION=1.16.0
PY=/usr/bin/python3
want_path=0
other=""
while [ $# -gt 0 ]; do
  case "$1" in
    --path) want_path=1; shift ;;
    --python) other=$2; shift 2 ;;
    *) echo "torch2-venv.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
cache=${BALLAST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ballast}

if [ -n "$other" ]; then
  venv="$cache/torch-$TORCH_VERSION-py$other"
  if [ "$want_path" = 1 ]; then echo "$venv/bin/python"; exit 0; fi
  [ -f "$venv/.ballast-ready" ] && { echo "$venv/bin/python"; exit 0; }
  pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
  base=$(ls -d "$pyenv_root/versions/$other".* 2>/dev/null | sort -V -r | head -1 || true)
  [ -n "$base" ] && [ -x "$base/bin/python3" ] || {
    echo "ballast: no CPython $other in $pyenv_root/versions (pyenv's; set PYENV_ROOT if it is elsewhere; nothing here downloads one)" >&2; exit 1; }
  first=$("$0")  # the CUDA libraries come from the default venv
  nvidia=$("$first" -c 'import os, nvidia; print(os.path.dirname(list(nvidia.__path__)[0]))')
  echo "ballast: building the torch $TORCH_VERSION venv for CPython $other in $venv (once; ~1 GB)" >&2
  rm -rf "$venv"
  "$base/bin/python3" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar on --no-deps \
    "torch==$TORCH_VERSION" "numpy==$NUMPY_VERSION" filelock typing-extensions sympy mpmath networkx jinja2 \
    markupsafe fsspec >&2 || {
    echo "ballast: pip could not install torch==$TORCH_VERSION for CPython $other into $venv (network?)" >&2; exit 1; }
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  ln -sfn "$nvidia/nvidia" "$site/nvidia"
  "$venv/bin/python" -c "import torch, torch.distributed as dist; assert dist.is_gloo_available(); print('ballast: torch', torch.__version__, 'ready for CPython $other')" >&2
  touch "$venv/.ballast-ready"
  echo "$venv/bin/python"
  exit 0
fi

pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
venv="$cache/torch-$TORCH_VERSION-py$pyver"
stamp="$venv/.ballast-ready"
hf_stamp="$venv/.ballast-hf-$TRANSFORMERS_VERSION-$ACCELERATE_VERSION"

install_hf() {
  [ -f "$hf_stamp" ] && return 0
  echo "ballast: installing transformers==$TRANSFORMERS_VERSION accelerate==$ACCELERATE_VERSION into $venv (once)" >&2
  # torch stays at its pin (a constraint, so pip never replaces it).
  "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar on \
    "transformers==$TRANSFORMERS_VERSION" "accelerate==$ACCELERATE_VERSION" "torch==$TORCH_VERSION" \
    "numpy==$NUMPY_VERSION" >&2 || {
    echo "ballast: pip could not install transformers/accelerate from PyPI into $venv (network?)" >&2; exit 1; }
  "$venv/bin/python" -c "import transformers, accelerate; print('ballast: transformers', transformers.__version__, 'ready')" >&2
  rm -f "$venv"/.ballast-hf-*
  touch "$hf_stamp"
}
if [ "$want_path" = 1 ]; then
  echo "$venv/bin/python"
  exit 0
fi
if [ -f "$stamp" ]; then
  install_hf
  echo "$venv/bin/python"
  exit 0
fi
echo "ballast: building the torch $TORCH_VERSION venv in $venv (once; ~5 GB, several minutes)" >&2
mkdir -p "$cache"
# Built in place; the stamp, written last, says it is whole. A venv without
# it (an install cut short) is removed and built again.
rm -rf "$venv"
"$PY" -m venv "$venv" >&2 || {
  echo "ballast: '$PY -m venv' failed: install python3-venv (apt-get install python3-venv)" >&2; exit 1; }
# pip prints a progress bar per wheel; keep it, it is the only sign of life
# during a 5 GB download.
"$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar on \
  "torch==$TORCH_VERSION" "numpy==$NUMPY_VERSION" >&2 || {
  echo "ballast: pip could not install torch==$TORCH_VERSION from PyPI into $venv (network? disk: df -h $cache)" >&2; exit 1; }
"$venv/bin/python" - >&2 <<PYEOF
import torch, torch.distributed as dist
assert torch.__version__.startswith("$TORCH_VERSION"), torch.__version__
assert dist.is_available() and dist.is_gloo_available()
print("ballast: torch", torch.__version__, "ready")
PYEOF
touch "$stamp"
install_hf
echo "$venv/bin/python"
