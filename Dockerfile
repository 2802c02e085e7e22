# reprotrain's container: the environment (base image + hashed CUDA lock) is
# baked in; the repository (code, params, data, DVC cache) is mounted at
# /workspace. Build: `make image`; run the pipeline: `make docker-repro`.
#
# The base is pinned by its multi-platform index digest: python:3.11-slim-bookworm,
# Python 3.11.16, Debian bookworm, built 2026-08-25 (linux/amd64 manifest:
# sha256:2fc9207f64226cb05ac317cee0bab6fa55a9ea311ce5a086baddd4b4a83c2d3c).
# Refresh with `docker buildx imagetools inspect python:3.11-slim-bookworm`.
# tests/test_container.py checks that every FROM is pinned by @sha256.
ARG BASE_IMAGE=python:3.11-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b
FROM ${BASE_IMAGE}

ARG BASE_IMAGE
# A fixed non-root user. Runs under another UID (`docker run --user`, as
# `make docker-repro` does) need no passwd entry: HOME, USER and LOGNAME are set
# here, so neither git nor DVC (getpass.getuser) looks the UID up.
ARG APP_UID=1000
ARG APP_GID=1000

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# git: DVC drives the mounted repository through it. Left unpinned on purpose:
# Debian drops superseded versions from its mirror, so a pin would break the
# build after the next security update; git does not touch the numerics, and
# the digest above fixes everything else in the OS. g++: torch.compile's CPU backend
# (Inductor) builds C++ with it; unpinned for the same reason, and a recipe that
# compiles has its version in the environment record, so an update retrains it
# (docs/compile.md). Inductor's cache is /tmp/torchinductor_<user>, gone with the
# container unless TORCHINDUCTOR_CACHE_DIR names a mounted folder.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends git g++ \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid "${APP_GID}" reprotrain \
    && useradd --uid "${APP_UID}" --gid "${APP_GID}" --home-dir /home/reprotrain \
        --create-home --shell /bin/bash reprotrain \
    && chmod 1777 /home/reprotrain \
    && git config --system --add safe.directory /workspace \
    && python3 -m venv /opt/venv

# REPROTRAIN_BASE_IMAGE reaches the environment record (and so the run ID);
# `make docker-repro` adds REPROTRAIN_IMAGE_ID, which an image cannot know of itself.
# REPROTRAIN_LOCK: the lock the `env` stage checks the installed packages against.
# PYTHONPATH: the mounted repository's code runs (the code DVC hashes), not the
# copy installed below, which only serves runs without a mount.
# DVC_SITE_CACHE_DIR: DVC's hash state lives on the mounted volume (in the
# git-ignored .dvc/tmp), so a fresh container does not re-hash every file.
ENV REPROTRAIN_BASE_IMAGE=${BASE_IMAGE} \
    REPROTRAIN_LOCK=requirements.lock \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONPATH=/workspace/src \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DVC_NO_ANALYTICS=1 \
    DVC_SITE_CACHE_DIR=/workspace/.dvc/tmp/site_cache \
    HOME=/home/reprotrain \
    USER=reprotrain \
    LOGNAME=reprotrain

# Every wheel (torch with CUDA 13, about 2.7 GB) is checked against the lock's sha256.
COPY requirements.lock /opt/reprotrain/requirements.lock
RUN pip install --no-cache-dir --require-hashes --no-deps -r /opt/reprotrain/requirements.lock

COPY pyproject.toml README.md /opt/reprotrain/project/
COPY src /opt/reprotrain/project/src
RUN pip install --no-cache-dir --no-deps --no-build-isolation /opt/reprotrain/project \
    && pip check \
    && dvc config --system core.analytics false \
    && dvc config --system core.check_update false

USER ${APP_UID}:${APP_GID}
WORKDIR /workspace
# `docker run IMAGE` reproduces the pipeline; `docker run IMAGE reprotrain verify`
# (or any other command) replaces it: there is no ENTRYPOINT to get in the way.
CMD ["dvc", "repro"]
