# The Ballast image: the `ballast` binary (operator, master, agent: `ballast operator`,
# `ballast master`, `ballast run`) and the `ballast` Python package with Debian's torch.
#
#   docker build -t ballast:0.1.0 .
#
# Training images build FROM it and add the training code:
#
#   FROM ballast:0.1.0
#   COPY train.py /workspace/train.py
#
# and run under an ElasticJob (examples/kubernetes/elasticjob.yaml): the operator wraps
# the container's command in `ballast run`.

# Shared libraries of the runtime image: the packages of what `ldd build/bin/ballast` and
# the Python extension list (libc6, libgcc-s1, libstdc++6 come with debian:12-slim).
# libcurl4 and libyaml-cpp0.7: the Kubernetes client (src/kube). The build stage checks
# this list against the binaries it built.
ARG RUNTIME_LIBS="libabsl20220623 libc-ares2 libcurl4 libfmt9 libgrpc++1.51 libgrpc29 \
libprotobuf32 libre2-9 libspdlog1.10 libssl3 libyaml-cpp0.7 zlib1g"

# ---- build: the Debian 12 toolchain and -dev packages (scripts/install-deps.sh)
FROM debian:12 AS build
ARG DEBIAN_FRONTEND=noninteractive
WORKDIR /src
# The package list alone first: this layer is reused until install-deps.sh changes.
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN scripts/install-deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
# BALLAST_WERROR=OFF: a different compiler mode (Release, NDEBUG) must not fail the image
# build on a new warning; CI builds with -Werror.
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr/local \
        -DBALLAST_WERROR=OFF \
 && cmake --build build --target ballast ballast_python \
 && DESTDIR=/stage cmake --install build \
 && strip /stage/usr/local/bin/ballast
# The runtime packages below must cover every shared library the binary and the Python
# extension link: map them (ldd -> dpkg -S) and fail the build on a package the list lacks.
ARG RUNTIME_LIBS
RUN set -e; \
    libs=$(ldd /stage/usr/local/bin/ballast /stage/usr/local/lib/python3*/dist-packages/ballast/_ballast*.so \
           | awk '/=>/ {print $3}' | sort -u); \
    need=$(for l in $libs; do \
             dpkg -S "$(readlink -f "$l")" 2>/dev/null || dpkg -S "$l" 2>/dev/null || echo "UNPACKAGED($l):"; \
           done \
           | cut -d: -f1 | sort -u); \
    echo "runtime packages the binaries link: $(echo $need)"; \
    missing=""; \
    for p in $need; do \
      case " $RUNTIME_LIBS libc6 libgcc-s1 libstdc++6 python3.11 libpython3.11 " in \
        *" $p "*) ;; *) missing="$missing $p" ;; esac; \
    done; \
    if [ -n "$missing" ]; then echo "Dockerfile: add to RUNTIME_LIBS:$missing" >&2; exit 1; fi

# ---- runtime
FROM debian:12-slim
ARG RUNTIME_LIBS
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends $RUNTIME_LIBS ca-certificates python3 python3-torch \
 && rm -rf /var/lib/apt/lists/*
# /usr/local/bin/ballast and /usr/local/lib/python3.11/dist-packages/ballast (on the
# sys.path of Debian's python3, so workers `import ballast` without PYTHONPATH).
COPY --from=build /stage/usr/local/ /usr/local/
RUN ballast --help >/dev/null && python3 -c "import ballast, torch"
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["ballast"]
