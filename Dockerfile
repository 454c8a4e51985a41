# One image for every process of the pipeline: outbox migrate | relay | worker | reconcile |
# dashboard, the provider simulator and the example shop (see docker-compose.yml).
# The base is pinned by version and digest: a rebuild starts from the same bytes. To move it, take
# the new tag's digest (`docker buildx imagetools inspect python:3.11.X-slim-bookworm`) and
# change both here.
FROM python:3.11.16-slim-bookworm@sha256:fe556eaffd0d96abd8685b83bb8a69addd0dc730fa193669a7df0d49ddcfac02

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Installed from a build directory that is removed afterwards: were the source tree the working
# directory at run time, `python -m outbox` would import it instead of the installed package,
# which is the one that carries the migrations (as outbox.migrations).
WORKDIR /build
COPY pyproject.toml README.md constraints.txt ./
COPY migrations/ migrations/
COPY outbox/ outbox/
COPY relay/ relay/
COPY reconciler/ reconciler/
# The dashboard extra (Starlette, Jinja2, uvicorn) serves `outbox dashboard`.
RUN pip install -c constraints.txt ".[dashboard]" && rm -rf /build

# The examples are not part of the package: the handler modules are found through PYTHONPATH,
# as an application's own would be.
COPY examples/ /app/examples/
ENV PYTHONPATH=/app
WORKDIR /app

RUN useradd --system --uid 10001 --no-create-home outbox
USER outbox

CMD ["outbox", "--help"]
