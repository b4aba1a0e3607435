#!/bin/sh
# Installs DLRover's Ray mode (the "unified" API, dlrover.python.unified: a
# PrimeMaster actor, an ElasticMaster sub-master actor and one ElasticWorker
# actor per rank, the training run in-process in each worker actor) for
# bench/ray_bench.py --systems dlrover, into a private directory that goes on
# PYTHONPATH only for that system's driver and actors.
#
# Nothing of Ray or torch is installed here: the bench runs on the Ray Train
# venv (`make -s ray-train`: Debian's python 3.11 with its torch 1.13, Ray 2.60
# and its pydantic 2 through a .pth). Every package goes in with --no-deps; the
# list is what `import dlrover.python.unified...` needs beyond that venv:
# omegaconf (DLConfig.user_config) with the antlr runtime omegaconf 2.3 pins,
# and Deprecated (imported by dlrover.python.common; wrapt comes from the Ray
# venv). Nothing that venv has is put here, so nothing of it is shadowed.
#
# usage: bench/setup_dlrover_ray.sh [DIR]   (default ~/.cache/ballast/dlrover-ray-0.6.1)
set -eu
VERSION=0.6.1
DIR=${1:-$HOME/.cache/ballast/dlrover-ray-$VERSION}
PY=/usr/bin/python3
if [ -e "$DIR" ]; then  # replace an earlier install, nothing else
    [ -d "$DIR/dlrover" ] || { echo "refusing to replace $DIR: not a dlrover install" >&2; exit 1; }
    rm -rf "$DIR"
fi
$PY -m pip install --quiet --no-deps --target "$DIR" \
    dlrover==$VERSION omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 deprecated==1.3.1
echo "dlrover $VERSION (Ray mode) installed in $DIR; check with:"
echo "  PYTHONPATH=$DIR \$(make -s ray-train) -c 'import dlrover.python.unified.api.builder, dlrover.python.unified.backend'"
