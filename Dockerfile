# One image for every component: `understudy operator run`, `understudy
# lockserver serve`, `understudy gms serve`, `understudy engine run` (each
# under `understudy respawn`, a container's small init, from the
# understudy-respawner distribution: docs/pod.md).
#
# Builds from any Debian bookworm rootfs with python3 (>= 3.11), python3-venv
# and ca-certificates; the network it needs is PyPI, and a Debian mirror for
# the build stage's compiler (optional: below). hack/cluster builds
# it with buildah on a local debootstrap base image:
#   buildah bud --build-arg BASE_IMAGE=localhost/understudy-base:bookworm -t localhost/understudy:dev .
#
# PACKAGES picks the workspace distributions to install (uv.lock pins them
# and everything they need). Empty, the default, means every component plus
# the reference model's files; a slim sidecar image takes only its own, e.g.
# --build-arg PACKAGES="understudy-lockserver" (8 MB of Python packages
# instead of 330 MB).
#
# Two stages. The first builds the venv (/opt/understudy) with a C compiler,
# so that the llama engine gets its decode kernels (engine_shim's optional
# extension, adapters/_decode.c: docs/performance.md); where no Debian mirror
# answers it goes on without one, and the engine decodes in numpy's forms. The
# image is the base and that venv: no compiler, no uv, no sources.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE} AS build

ARG PACKAGES=""
# UV_SYSTEM_CERTS: trust the image's CA store (which may carry a corporate or
# proxy root), as pip does, rather than uv's bundled roots.
# UV_COMPILE_BYTECODE: the bytecode is built once, here; the root file system
# is read-only and PYTHONDONTWRITEBYTECODE is set, so without it every process
# start would compile every module it imports (a restarted front's start is
# what its queued connections wait for).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PROJECT_ENVIRONMENT=/opt/understudy \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_SYSTEM_CERTS=1 \
    UV_COMPILE_BYTECODE=1 \
    VIRTUAL_ENV=/opt/understudy \
    PATH=/opt/understudy/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp

RUN (apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null) \
    || echo "no C compiler here: the llama engine will decode in numpy's forms"
RUN python3 -m venv /opt/uv && /opt/uv/bin/pip install --quiet "uv==0.13.9"
WORKDIR /src
COPY . .
# Non-editable: the image holds built wheels of the components, not the tree.
# The uv cache mount keeps rebuilds after a source change to a few seconds.
RUN --mount=type=cache,target=/tmp/.cache/uv \
    set -e; args="--all-packages --group models"; \
    if [ -n "${PACKAGES}" ]; then args=""; for p in ${PACKAGES}; do args="$args --package $p"; done; fi; \
    /opt/uv/bin/uv sync --frozen --no-dev --no-editable --all-extras --python python3 $args \
 && rm -rf /src \
 && /opt/understudy/bin/understudy --help >/dev/null \
 && /opt/understudy/bin/understudy respawn --help >/dev/null

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/understudy \
    PATH=/opt/understudy/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp
COPY --from=build /opt/understudy /opt/understudy
RUN understudy --help >/dev/null && understudy respawn --help >/dev/null

# Non-root, matching the pods' runAsUser (docs/operator.md). A passwd entry,
# because kopf names its peering identity after getpass.getuser().
RUN echo "understudy:x:65532:65532:understudy:/tmp:/usr/sbin/nologin" >> /etc/passwd \
 && echo "understudy:x:65532:" >> /etc/group
USER 65532:65532
WORKDIR /tmp
ENTRYPOINT ["understudy"]
CMD ["--help"]
