#!/usr/bin/env bash
# Installs the Debian 12 packages Ballast builds and tests with, and any named
# on the command line (`make fuzz` adds clang). Idempotent: does nothing (and
# needs no network) when every package is already installed.
#
#   scripts/install-deps.sh --build   only what building the product and its
#                                     wheel needs (the Dockerfile's build stage)
set -euo pipefail
# The product: the binary, the Python extension, the wheel (scripts/build-wheels.sh:
# python3-venv, and ccache, which makes every Python version's build of the C++
# core after the first one a cache hit).
BUILD_PKGS=(
  cmake ninja-build g++ make pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev
  libyaml-cpp-dev libcpp-httplib-dev libcurl4-openssl-dev
  pybind11-dev python3-dev python3-venv ccache ca-certificates
)
if [ "${1:-}" = "--build" ]; then
  shift
  PKGS=("${BUILD_PKGS[@]}" "$@")
else
PKGS=(
  "${BUILD_PKGS[@]}"
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch procps iproute2 util-linux openssl curl
  # Test infrastructure: a real Prometheus (and promtool) scrapes a job's
  # /metrics, a real headless Chromium loads its dashboard.
  prometheus chromium
  # `ballast simulate --png` draws its chart with matplotlib.
  python3-matplotlib
  # The Helm chart's test reads helm's rendered YAML.
  python3-yaml
  # Test infrastructure for the Slurm backend tests: a real multi-node Slurm
  # (slurmctld + one slurmd per network namespace, munge auth) built by
  # tests/slurm/slurm_cluster.py.
  slurmctld slurmd slurm-client munge
  # The container image test (tests/container): a Debian 12 base made with
  # debootstrap, the Dockerfile built with buildah, containers run with podman.
  debootstrap buildah podman
  "$@"
)
fi
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
