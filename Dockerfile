# capsvc: multi-stage build, slim runtime, non-root.
# docker build -t capsvc . && docker run -p 8080:8080 \
#   -v $PWD/capsvc.toml:/etc/capsvc/capsvc.toml:ro -v capsvc-journal:/var/lib/capsvc/journal \
#   -e CAPSVC_REDIS_URL=redis://redis:6379/0 capsvc

# The base image pinned by digest (python:3.11-slim, linux/amd64 among its platforms): the
# same bytes from the same commit. Move it on purpose, in a commit of its own, to the digest
# `docker buildx imagetools inspect python:3.11-slim` prints.
FROM python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7 AS build
WORKDIR /src
# Every dependency pinned with the hashes of its files (requirements.lock, written from
# constraints.txt by deploy/lock.py), the build backend's too, into a virtual environment
# that the runtime stage copies. The embedded local Redis (the `embedded` extra) is not
# installed: the service runs on the Redis it is configured with.
COPY requirements.lock ./
RUN python -m venv /opt/capsvc \
 && /opt/capsvc/bin/pip install --no-cache-dir --require-hashes --only-binary=:all: \
      -r requirements.lock
# capsvc itself, built from this checkout with the backend installed above; nothing fetched.
COPY pyproject.toml README.md ./
COPY capsvc capsvc
COPY lua lua
RUN /opt/capsvc/bin/pip install --no-cache-dir --no-index --no-deps --no-build-isolation .

FROM python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7
RUN groupadd --system --gid 10001 capsvc \
 && useradd --system --uid 10001 --gid capsvc --create-home --home-dir /app capsvc \
 && install -d -o capsvc -g capsvc -m 0750 /var/lib/capsvc/journal
COPY --from=build /opt/capsvc /opt/capsvc
ENV PATH=/opt/capsvc/bin:$PATH
# Named for readability; its uid and gid are fixed (10001) and the Kubernetes manifests set
# runAsUser/runAsGroup: 10001, so runAsNonRoot is verified on the number (deploy/k8s/README.md).
# hadolint ignore=DL3066
USER capsvc
WORKDIR /app
# The configuration (games, channels with token hashes) is mounted here; the Redis URL
# comes from the environment (CAPSVC_REDIS_URL) or from the file's [redis] url (as in
# deploy/k8s/, where it is a Secret). There is deliberately no default: the built-in local
# configuration has public example tokens.
# The journal (the decisions answered) is written to the volume below whatever the
# configuration's [journal] dir says (CAPSVC_JOURNAL_DIR overrides it; the default,
# var/journal, would be in the container's own layer, gone with the container). Mount a
# volume here (-v capsvc-journal:/var/lib/capsvc/journal), else Docker makes an anonymous
# one that `docker rm -v` deletes. A new named volume takes this directory's owner, capsvc
# (10001).
ENV CAPSVC_CONFIG=/etc/capsvc/capsvc.toml \
    CAPSVC_JOURNAL_DIR=/var/lib/capsvc/journal \
    PYTHONUNBUFFERED=1
VOLUME ["/var/lib/capsvc/journal"]
# The port is the configuration's [server] port (8080 unless it says otherwise): serve
# and the health check both read it from the mounted file.
EXPOSE 8080
# Exec form (no shell): `capsvc health` GETs /healthz on the configured port; anything but
# a 200 (refused, timeout) exits 1, which Docker counts as unhealthy.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["capsvc", "health"]
STOPSIGNAL SIGTERM
CMD ["capsvc", "serve", "--host", "0.0.0.0"]
