#!/bin/sh
# Installs DLRover (dlrover-run and its local job master) for recovery_bench.py
# into a private directory, without torch: Debian's python3-torch 1.13 is used,
# and every package goes in with --no-deps so pip pulls in nothing else.
# The list is what `dlrover-run --standalone` imports on Python 3.11:
# grpc/protobuf for agent <-> master, kubernetes (imported by the local master
# even on --platform local; 31.0.0 is the newest without pydantic/aiohttp) and
# its pure-Python deps that Debian lacks. One pip call: `--target` skips
# packages whose top-level dir (google/ for protobuf and google-auth) exists.
#
# usage: bench/setup_dlrover.sh [DIR]   (default ~/.cache/ballast/dlrover-0.6.1)
set -eu
VERSION=0.6.1
DIR=${1:-$HOME/.cache/ballast/dlrover-$VERSION}
PY=/usr/bin/python3
if [ -e "$DIR" ]; then  # replace an earlier install, nothing else
    [ -d "$DIR/dlrover" ] || { echo "refusing to replace $DIR: not a dlrover install" >&2; exit 1; }
    rm -rf "$DIR"
fi
$PY -m pip install --quiet --no-deps --target "$DIR" \
    dlrover==$VERSION grpcio==1.85.3 protobuf==4.25.3 packaging==26.4 deprecated==1.3.1 wrapt==2.5.2 \
    kubernetes==31.0.0 google-auth==2.63.0 pyasn1==0.6.5 pyasn1-modules==0.4.2 websocket-client==1.9.2 \
    requests-oauthlib==2.0.0 durationpy==0.11
PYTHONPATH="$DIR" $PY -c "import dlrover.trainer.torch.elastic_run, dlrover.python.master.local_master" >/dev/null 2>&1 \
    || { echo "dlrover in $DIR does not import; run the line above without >/dev/null to see why" >&2; exit 1; }
echo "dlrover $VERSION installed in $DIR"
