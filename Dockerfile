# kvindex: the indexer service (`kvindex serve`) and the engine simulator (`kvindex sim`) in one image.
# Build: docker build -t kvindex .      Run: docker run --rm kvindex --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the package needs to install (see .dockerignore); tests and docs stay out of the image.
COPY pyproject.toml README.md ./
COPY kvindex ./kvindex
COPY hashing ./hashing
COPY replay ./replay
COPY indexer ./indexer
COPY sim ./sim
COPY api ./api
COPY sidecar ./sidecar
COPY demo ./demo
COPY cli ./cli
RUN pip install . && rm -rf /src

# Run as an unprivileged user; nothing is written to disk.
RUN useradd --system --uid 10001 --no-create-home kvindex
USER kvindex
WORKDIR /

# 8080: kvindex HTTP API and /metrics. 5557/5558/8000: `kvindex sim` (PUB, replay ROUTER, HTTP).
# 5567/5568/8081: `kvindex sidecar` (downstream PUB, replay ROUTER, snapshot/status/metrics HTTP).
EXPOSE 8080 5557 5558 8000 5567 5568 8081
ENTRYPOINT ["kvindex"]
CMD ["--help"]
