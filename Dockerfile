# syntax=docker/dockerfile:1
# cascade-service:latest, the image every file under deploy/ names. From the repository root:
#   docker build -t cascade-service:latest .                               CUDA torch: the GPU cluster's image
#   docker build --build-arg TORCH_VARIANT=cpu -t cascade-service:cpu .    CPU-only torch, a far smaller image
# docs/deployment.md says how to run it; tests/unit/test_image.py checks this file (no Docker needed).

ARG PYTHON_VERSION=3.11

# The package as a wheel: setuptools and the sources stay in this stage.
FROM python:${PYTHON_VERSION}-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cascade_service ./cascade_service
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim
# Which torch build: cpu (PyTorch's CPU index), cuda (PyPI's Linux wheel, built with the CUDA release
# PyTorch chose for that version; it bundles the CUDA libraries, so a node needs only the NVIDIA
# driver), or one of PyTorch's CUDA indexes by name (cu126, cu128, ...) where that version has a build.
ARG TORCH_VARIANT=cuda
# Inside pyproject's torch range: the version CI tests with (.ci/run).
ARG TORCH_VERSION=2.13.0
# Must equal rayVersion in deploy/kuberay/rayservice.yaml: every node of a cluster runs the same Ray.
ARG RAY_VERSION=2.60.0

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1

# Tools the cluster managers run inside this container: KubeRay's readiness and liveness probes call
# wget; the Ray cluster launcher copies files in with rsync, and its autoscaler on the head sets up
# workers over ssh. Debian's versions are left to the base image's release (pins would break as the
# security updates move on).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget rsync openssh-client \
    && rm -rf /var/lib/apt/lists/*

# Into the system site-packages, with the commands in /usr/local/bin, not a virtualenv on a PATH set
# here: KubeRay and the cluster launcher run `ray start` in login shells (`bash -l`), and Debian's
# /etc/profile resets PATH. (hadolint takes "$@", the index option, for an unpinned package.)
# hadolint ignore=DL3013
RUN case "${TORCH_VARIANT}" in \
        cuda) set -- ;; \
        cpu|cu[0-9]*) set -- --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" ;; \
        *) echo "TORCH_VARIANT must be cpu, cuda or cuNNN, got '${TORCH_VARIANT}'" >&2; exit 1 ;; \
    esac \
    && pip install "$@" "torch==${TORCH_VERSION}"

# The package's dependencies (pyproject's list and its [serve] extra, Ray pinned, the torch above kept)
# in a layer of their own, so that a code change rebuilds only the small layer after it.
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *p['optional-dependencies']['serve'], sep=chr(10))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "ray[serve]==${RAY_VERSION}" "torch==${TORCH_VERSION}" \
    && rm /tmp/pyproject.toml /tmp/requirements.txt

COPY --from=wheel /wheels /wheels
RUN pip install --no-deps /wheels/*.whl && rm -rf /wheels

# A fixed uid, so Kubernetes' runAsNonRoot can check it and mounted volumes can be prepared for it.
# /models is where the deploy files put the zoo (CASCADE_SERVICE_HOME); owned by that user, so
# `zoo build` can fill it when nothing is mounted there.
RUN groupadd --gid 1000 cascade \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash cascade \
    && mkdir -p /models \
    && chown 1000:1000 /models
COPY configs /app/configs
ENV CASCADE_SERVICE_HOME=/models
WORKDIR /home/cascade
USER 1000:1000

# Standalone serving on one machine (no Ray): the cluster config's tiers on its GPU, sessions in Redis
# at $CASCADE_REDIS_URL. Reachable from outside the container only with API keys and TLS, so mount them
# at /secrets (docs/deployment.md). On a Ray cluster the cluster manager replaces this command.
EXPOSE 9000
ENTRYPOINT ["cascade-service"]
CMD ["serve", "--config", "/app/configs/cluster.yaml", "--frontend", "standalone", "--host", "0.0.0.0", \
     "--api-keys", "/secrets/api_keys.txt", "--tls-cert", "/secrets/tls.crt", "--tls-key", "/secrets/tls.key"]
