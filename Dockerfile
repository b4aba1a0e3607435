# The Ballast image: Ballast's wheel (the `ballast` binary: operator, master, agent:
# `ballast operator`, `ballast master`, `ballast run`; and the `ballast` Python package)
# installed with pip, beside Debian's torch.
#
#   docker build -t ballast:0.1.0 .
#
# Training images build FROM it and add the training code:
#
#   FROM ballast:0.1.0
#   COPY train.py /workspace/train.py
#
# and run under an ElasticJob (examples/kubernetes/elasticjob.yaml): the operator wraps
# the container's command in `ballast run`. An image of your own (another Python,
# PyPI's torch, CUDA) needs only `pip install ballast-<version>-cp3XY-...whl`: the wheel
# carries the shared libraries it needs (docs/install.md).

# Build arguments:
#   BASE    the Debian 12 image both stages start from (default debian:12; a local
#           one, e.g. made with debootstrap: tests/container/test_image.py)
#   WHEELS  build: compile the wheel in the build stage (default);
#           context: take it from dist/ in the build context (`make wheel` first),
#           no build stage at all.
ARG BASE=debian:12
ARG WHEELS=build

# ---- build: the Debian 12 toolchain and -dev packages (scripts/install-deps.sh
# --build), then the wheel for Debian's python3 (scripts/build-wheels.sh:
# scikit-build-core, pybind11 and auditwheel from PyPI).
FROM ${BASE} AS wheels-build
ARG DEBIAN_FRONTEND=noninteractive
WORKDIR /src
# The package list alone first: this layer is reused until install-deps.sh changes.
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN scripts/install-deps.sh --build && rm -rf /var/lib/apt/lists/*
COPY . .
RUN scripts/build-wheels.sh --out /wheels --work /tmp/wheel-build 3.11

FROM ${BASE} AS wheels-context
COPY dist/ /wheels/

FROM wheels-${WHEELS} AS wheels
RUN ls /wheels/ballast-*-cp311-*.whl \
 || { echo "Dockerfile: no ballast-*-cp311-*.whl in /wheels (WHEELS=context: run make wheel first)" >&2; exit 1; }

# ---- runtime: no -dev packages, no build tree; the wheel is self-contained.
FROM ${BASE}
ARG DEBIAN_FRONTEND=noninteractive
# (A base that has them already, like the tests' debootstrap one, fetches nothing.)
ARG RUNTIME_PKGS="ca-certificates python3 python3-venv python3-torch"
RUN dpkg-query -W $RUNTIME_PKGS >/dev/null 2>&1 || { apt-get update \
 && apt-get install -y --no-install-recommends $RUNTIME_PKGS \
 && rm -rf /var/lib/apt/lists/*; }
# A venv that sees Debian's torch (--system-site-packages); its bin/ is on PATH, so
# `ballast` and the `python` the workers run are the venv's.
COPY --from=wheels /wheels /tmp/wheels
RUN python3 -m venv --system-site-packages /opt/ballast \
 && /opt/ballast/bin/pip install --no-index --no-deps /tmp/wheels/ballast-*-cp311-*.whl \
 && rm -rf /tmp/wheels
ENV PATH=/opt/ballast/bin:$PATH PYTHONUNBUFFERED=1
RUN ballast --version && python -c "import ballast, torch"
ENTRYPOINT ["ballast"]
