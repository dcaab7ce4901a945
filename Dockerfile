# relay container image: `docker build -t relay .`, then `docker run relay --help`.
#
# Two stages so that the source tree and the build tools stay out of the final
# image: relay is installed into a virtualenv at /opt/relay (the same layout as
# the systemd units) and only that venv is copied over.
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/relay
WORKDIR /src
COPY . .
RUN /opt/relay/bin/pip install --no-cache-dir .

FROM python:3.11-slim
# Numeric UID/GID: Kubernetes' runAsNonRoot can only check a numeric USER.
RUN groupadd --system --gid 10001 relay \
 && useradd --system --uid 10001 --gid relay --no-create-home --shell /usr/sbin/nologin relay
COPY --from=build /opt/relay /opt/relay
# PYTHONDONTWRITEBYTECODE: the image runs with a read-only root file system in
# Kubernetes; PYTHONUNBUFFERED: logs (stderr) reach `docker logs` at once.
ENV PATH=/opt/relay/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# The --http-port values used in this repo's examples: outbox 9108, inbox 9109.
EXPOSE 9108 9109
ENTRYPOINT ["relay"]
CMD ["--help"]
