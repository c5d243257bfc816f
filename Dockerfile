# The project image: every diloco role (learner, aggregator, monitor, eval, metrics, up) on CPU.
#   docker build -t decoupled-diloco .
#   docker run --rm -e DILOCO_NATS_URL=nats://nats.example.com:4222 -e DILOCO_LEARNER_ID=us-0 \
#              -e DILOCO_REGION=us decoupled-diloco diloco learner
# The default corpus (DILOCO_DATA empty) is this image's Python standard library sources, so every
# container of a run reads the same bytes; mount a volume and set DILOCO_DATA for your own corpus.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    JAX_PLATFORMS=cpu

WORKDIR /src
# pyproject.toml names README.md as the long description: both are needed to build the wheel
COPY pyproject.toml README.md ./
COPY bus ./bus
COPY learner ./learner
COPY aggregator ./aggregator
COPY monitor ./monitor
COPY simulation ./simulation
COPY diloco ./diloco
RUN pip install . \
    && useradd --create-home --uid 10001 diloco \
    && mkdir -m 0700 /auth && chown diloco:diloco /auth
# /auth: where compose mounts the run's credentials volume; a new named volume takes this folder's
# owner, so the auth service (running as diloco) can write into it

USER diloco
WORKDIR /home/diloco
# no ports: diloco processes only dial out to NATS
CMD ["diloco", "--help"]
