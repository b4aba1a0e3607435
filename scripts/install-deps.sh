#!/usr/bin/env bash
# Installs the Debian 12 packages Ballast builds and tests with, and any named
# on the command line (`make fuzz` adds clang). Idempotent: does nothing (and
# needs no network) when every package is already installed.
set -euo pipefail
PKGS=(
  cmake ninja-build g++ make pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev
  libyaml-cpp-dev libcpp-httplib-dev libcurl4-openssl-dev
  pybind11-dev python3-dev libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch procps iproute2 util-linux openssl curl ca-certificates
  # Test infrastructure: a real Prometheus (and promtool) scrapes a job's
  # /metrics, a real headless Chromium loads its dashboard.
  prometheus chromium
  # `ballast simulate --png` draws its chart with matplotlib.
  python3-matplotlib
  # The Helm chart's test reads helm's rendered YAML.
  python3-yaml
  # `make wheel`: every Python version's build of the C++ core after the first one
  # is a cache hit (ccache).
  ccache
  # Test infrastructure for the Slurm backend tests: a real multi-node Slurm
  # (slurmctld + one slurmd per network namespace, munge auth) built by
  # tests/slurm/slurm_cluster.py.
  slurmctld slurmd slurm-client munge
  "$@"
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "ballast: installing missing Debian packages: ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "ballast: need root (or sudo) to apt-get install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
