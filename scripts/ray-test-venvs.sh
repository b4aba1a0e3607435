#!/usr/bin/env bash
# The venvs the Ray tests (tests/python/test_ray.py) run in, both seeing the
# cached Ray venv (scripts/ray-venv.sh) through a .pth, so Ray is installed
# once per machine:
#   BUILD_DIR/venv-ray      torch 1.13: a venv of Debian's /usr/bin/python3 with
#                           its site-packages (Debian's torch); Ballast from the
#                           build tree (the test sets PYTHONPATH)
#   BUILD_DIR/venv-torch2   torch 2.x: the torch 2.x suites' venv with Ballast's
#                           wheel (scripts/torch2-wheel-venv.sh, run before this)
#
#   scripts/ray-test-venvs.sh BUILD_DIR
set -euo pipefail
build=$(cd "${1:?usage: ray-test-venvs.sh BUILD_DIR}" && pwd)
ray_python=$("$(dirname "$0")/ray-venv.sh")
ray_site=$("$ray_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv="$build/venv-ray"
if [ ! -x "$venv/bin/python" ]; then
  /usr/bin/python3 -m venv --system-site-packages "$venv" >&2
fi
for v in "$venv" "$build/venv-torch2"; do
  [ -x "$v/bin/python" ] || { echo "ballast: no venv at $v (make test-wheels builds it)" >&2; exit 1; }
  site=$("$v/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$ray_site" > "$site/ballast-ray.pth"
  "$v/bin/python" -c 'import ray' || { echo "ballast: ray does not import in $v" >&2; exit 1; }
done
echo "$venv/bin/python"
