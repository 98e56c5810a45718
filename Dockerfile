# The pipeline's image: relay, workers, migrations, the demo and its payment API.
#   docker build -t outbox-pipeline .
#   docker compose up            (see docker-compose.yml)
FROM python:3.11.9-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# Every dependency ships as a wheel (psycopg[binary] included): no compiler needed.
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
RUN pip install . \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin pipeline

USER pipeline
EXPOSE 9464 9465 8080
CMD ["pipeline", "--help"]
