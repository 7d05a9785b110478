# syntax=docker/dockerfile:1
#
# quarry's application image: the `quarry` CLI, the query API and the Prefect flows.
# Thin and CPU-only: it installs the project WITHOUT the `local` extra, so there is no
# torch and no model in it. Embeddings and reranking come from the TEI services in
# compose.yaml (QUARRY_EMBED_URL / QUARRY_RERANK_URL).
#
#   docker build -t quarry:0.1.0 .        (compose.yaml builds and tags it the same way)
#
# One image, two roles in compose.yaml: `quarry api ...` (the query API) and
# `prefect worker start --pool quarry ...` (the Prefect worker). There is no ENTRYPOINT,
# so either command runs as given; the default command is the query API.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

# A C compiler for this stage only: the build compiles the chunker's hot path
# (hatch_build.py: quarry._cpieces and quarry.chunking through mypyc). The final
# stage copies the built environment and has no compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

RUN python -m venv /opt/quarry
WORKDIR /src

# The Prefect client must match the Prefect server in compose.yaml
# (prefecthq/prefect:<PREFECT_VERSION>-python3.11); tests/deploy checks they agree.
ARG PREFECT_VERSION=3.9.1

# What hatchling needs to build the project, and nothing else (see .dockerignore).
COPY pyproject.toml README.md hatch_build.py ./
COPY src ./src
COPY flows ./flows

# `pip install .`, deliberately not `.[local]`: the local extra is torch and
# sentence-transformers for the embedded default, which a served stack never uses.
# hatchling stays in the image so that the worker's pull step (prefect.yaml) can
# reinstall checked-out code with --no-build-isolation, without reaching an index;
# with no compiler there, that reinstall runs the chunker as plain Python (the same
# chunks, about 2x slower: still far ahead of what the embedding service takes in).
RUN /opt/quarry/bin/pip install . "prefect==${PREFECT_VERSION}" "hatchling>=1.25" \
 && ! /opt/quarry/bin/pip show torch >/dev/null 2>&1


FROM ${PYTHON_IMAGE}

# git: the worker's pull step clones the flow code (prefect.deployments.steps.git_clone).
# curl: container health checks, and Qdrant snapshot calls from inside the stack
#       (docs/operations.md, "Backups").
RUN apt-get update \
 && apt-get install -y --no-install-recommends git curl ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# A fixed non-root uid/gid, so that bind-mounted sources only need to be readable by it.
RUN groupadd --system --gid 10001 quarry \
 && useradd --system --uid 10001 --gid quarry --create-home --home-dir /home/quarry quarry \
 && mkdir -p /var/lib/quarry /srv/sources \
 && chown quarry:quarry /var/lib/quarry

# The venv belongs to the runtime user: the worker's pull step installs the
# checked-out revision of quarry into it before each flow run.
COPY --from=build --chown=quarry:quarry /opt/quarry /opt/quarry

ENV PATH=/opt/quarry/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    QUARRY_DATA_DIR=/var/lib/quarry \
    PREFECT_HOME=/var/lib/quarry/prefect

USER quarry:quarry
WORKDIR /home/quarry

EXPOSE 8080

# No HEALTHCHECK here: the same image runs the API and the Prefect worker, which are
# checked differently. compose.yaml defines one per service.
CMD ["quarry", "api", "--host", "0.0.0.0", "--port", "8080"]
