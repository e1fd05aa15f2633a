# capsvc: multi-stage build, slim runtime, non-root.
# docker build -t capsvc . && docker run -p 8080:8080 \
#   -v $PWD/capsvc.toml:/etc/capsvc/capsvc.toml:ro -v capsvc-journal:/var/lib/capsvc/journal \
#   -e CAPSVC_REDIS_URL=redis://redis:6379/0 capsvc

FROM python:3.11-slim AS build
WORKDIR /src
# Every version pinned (constraints.txt), the build backend's too: the same image from the
# same commit. The embedded local Redis (the `embedded` extra) is not installed: the
# service runs on the Redis it is configured with.
ENV PIP_CONSTRAINT=/src/constraints.txt
COPY constraints.txt pyproject.toml README.md ./
COPY client client
COPY capsvc capsvc
COPY lua lua
RUN pip wheel --no-cache-dir --wheel-dir /wheels ./client .

FROM python:3.11-slim
RUN groupadd --system --gid 10001 capsvc \
 && useradd --system --uid 10001 --gid capsvc --create-home --home-dir /app capsvc \
 && install -d -o capsvc -g capsvc -m 0750 /var/lib/capsvc/journal
COPY --from=build /wheels /wheels
COPY --from=build /src/constraints.txt /tmp/constraints.txt
RUN pip install --no-cache-dir --no-index --find-links /wheels --constraint /tmp/constraints.txt \
      capsvc \
 && rm -rf /wheels /tmp/constraints.txt
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
