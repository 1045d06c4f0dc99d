# syntax=docker/dockerfile:1
# The qo-ops user-code image: the Dagster code location (`dagster api grpc -m qo_ops.definitions`,
# the default command), its run workers (started by the K8sRunLauncher with their own args),
# and the `qo-ops` CLI, operator API and metrics exporter. One image, every process of qo-ops.
#
#   docker build -t REGISTRY/qo-ops:$(git rev-parse --short HEAD) .
#
# The base is pinned to a patch release. Pin it to a digest as well when you build: resolve
# the tag once (`docker buildx imagetools inspect python:3.11.14-slim-bookworm`) and pass
# --build-arg PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:<digest> (docs/deploy.md).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY constraints.txt ./
# The build backend comes from constraints.txt too: no unpinned build isolation.
RUN python -m venv /opt/qo-ops \
    && /opt/qo-ops/bin/pip install --no-cache-dir -c constraints.txt setuptools wheel
COPY pyproject.toml README.md ./
COPY qo_ops ./qo_ops
# Every version is pinned by constraints.txt (-c); no [dev] extra: no test or lint tools.
# dagster-k8s: run workers load the instance, whose run launcher is the K8sRunLauncher.
# dumb-init: the image's PID 1 (a static binary in a wheel, pinned like everything else).
# The installer itself does not go to the runtime stage, nor do the test suites and C headers
# that pandas, numpy and pyarrow ship inside their wheels (71 MB nothing imports), nor
# pgserver, the embedded PostgreSQL (32 MB): a pod whose QO_OPS_DATABASE_URL is missing then
# stops with one line instead of starting an empty database of its own.
RUN /opt/qo-ops/bin/pip install --no-cache-dir --no-build-isolation -c constraints.txt \
        . dagster-k8s dumb-init \
    && /opt/qo-ops/bin/pip uninstall --yes pip setuptools wheel pgserver \
    && site=/opt/qo-ops/lib/python3.11/site-packages \
    && rm -rf "$site"/pandas/tests "$site"/numpy/tests "$site"/numpy/*/tests \
        "$site"/pyarrow/tests "$site"/pyarrow/include

FROM ${PYTHON_IMAGE}
# A fixed numeric user, so Kubernetes can check runAsNonRoot without reading /etc/passwd.
RUN groupadd --system --gid 10001 qo-ops \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/qo-ops \
        --shell /usr/sbin/nologin qo-ops \
    && mkdir -p /var/lib/qo-ops /opt/dagster/dagster_home \
    && chown 10001:10001 /var/lib/qo-ops /opt/dagster/dagster_home
COPY --from=build /opt/qo-ops /opt/qo-ops
# DAGSTER_HOME is where the chart mounts dagster.yaml (global.dagsterHome); run workers write
# their op outputs beside it. QO_OPS_HOME holds archives and stored objects: mount a volume.
ENV PATH=/opt/qo-ops/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DAGSTER_HOME=/opt/dagster/dagster_home \
    QO_OPS_HOME=/var/lib/qo-ops
USER 10001:10001
WORKDIR /var/lib/qo-ops
# 3030 code location (gRPC), 8090 operator API, 9464 metrics exporter
EXPOSE 3030 8090 9464
# For `docker run` of the default command; Kubernetes ignores it and uses the probes in
# deploy/ (the chart probes the code location with this same command).
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["dagster", "api", "grpc-health-check", "-p", "3030"]
# An init as PID 1: it forwards SIGTERM to the process it starts and reaps orphans (the
# kernel drops signals that PID 1 has no handler for). The chart, the K8sRunLauncher and
# deploy/ pass whole commands as container args, which come after it.
ENTRYPOINT ["/opt/qo-ops/bin/dumb-init", "--"]
CMD ["dagster", "api", "grpc", "-h", "0.0.0.0", "-p", "3030", "-m", "qo_ops.definitions"]
