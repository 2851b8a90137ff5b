# syntax=docker/dockerfile:1
#
# One image for every Sluicegate role, in two flavours built from this file:
#
#   docker build --target gateway -t sluicegate:0.1.0 .         gateway, migrate, keys (no torch)
#   docker build --target engine  -t sluicegate:0.1.0-engine .  all of that, plus engine workers
#
# The engine flavour installs the `engine` extra. On x86_64 Linux the default torch wheels
# carry CUDA; to pick another build pass --build-arg PIP_EXTRA_INDEX_URL=<torch wheel index>.
# Run an engine with the NVIDIA container toolkit (`--gpus all`, or the Helm chart's GPU requests).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# tini as PID 1 forwards SIGTERM to sluicegate (which drains in-flight streams) and reaps
# children such as the compiler Triton spawns.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 sluicegate \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/sluicegate sluicegate

# Dependencies come from pyproject.toml alone, so editing the source never reinstalls them.
FROM base AS deps-gateway
COPY pyproject.toml /tmp/pyproject.toml
RUN python -m venv /opt/venv \
    && python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

FROM deps-gateway AS deps-engine
ARG PIP_EXTRA_INDEX_URL
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['optional-dependencies']['engine']))" > /tmp/requirements-engine.txt \
    && pip install -r /tmp/requirements-engine.txt

# The source is installed in place (editable) under /app so `sluicegate migrate` finds
# alembic.ini and migrations/ beside the package, exactly as in a checkout.
FROM base AS source
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY sluicegate ./sluicegate
COPY migrations ./migrations

FROM base AS engine
# Triton builds a small C launcher the first time it runs a kernel: it needs a C compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=deps-engine /opt/venv /opt/venv
COPY --from=source /app /app
WORKDIR /app
RUN pip install --no-deps -e .
ENV HOME=/home/sluicegate
USER 10001:10001
EXPOSE 8000 9100
ENTRYPOINT ["tini", "--", "sluicegate"]
CMD ["gateway", "--host", "0.0.0.0", "--port", "8000"]

# Last, so a plain `docker build .` gives the small, torch-free gateway image.
FROM base AS gateway
COPY --from=deps-gateway /opt/venv /opt/venv
COPY --from=source /app /app
WORKDIR /app
RUN pip install --no-deps -e .
ENV HOME=/home/sluicegate
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["tini", "--", "sluicegate"]
CMD ["gateway", "--host", "0.0.0.0", "--port", "8000"]
