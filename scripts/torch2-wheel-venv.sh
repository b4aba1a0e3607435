#!/usr/bin/env bash
# The venv the torch 2.x test suites run in, as a user's would be: Ballast's
# cp311 wheel pip-installed (no PYTHONPATH), torch 2.x from the cached venv
# (scripts/torch2-venv.sh) through a .pth, so that the 5 GB are not copied.
#
#   scripts/torch2-wheel-venv.sh BUILD_DIR   -> BUILD_DIR/venv-torch2/bin/python
#       installs the newest BUILD_DIR/wheels/ballast-*-cp311-*.whl (make test
#       builds it first) in place of the one there.
set -euo pipefail
build=$(cd "${1:?usage: torch2-wheel-venv.sh BUILD_DIR}" && pwd)
venv="$build/venv-torch2"
torch_python=$("$(dirname "$0")/torch2-venv.sh" --path)
wheel=$(ls -t "$build"/wheels/ballast-*-cp311-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || { echo "ballast: no cp311 wheel in $build/wheels: scripts/build-wheels.sh --out $build/wheels 3.11" >&2; exit 1; }
if [ ! -x "$venv/bin/python" ]; then
  /usr/bin/python3 -m venv "$venv" >&2
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$torch_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/ballast-torch2.pth"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps --force-reinstall "$wheel" >&2
echo "$venv/bin/python"
