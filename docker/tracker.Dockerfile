# syntax=docker/dockerfile:1
# protocol-tracker: a run's front door (manifest, bootstrap addresses) and its status page.
#
#   docker build -f docker/tracker.Dockerfile -t protocol-tracker .
#   docker run -d -p 8000:8000 -p 31338:31338 -v tracker-data:/data \
#       -v "$PWD/manifest.json:/data/manifest.json:ro" \
#       -e PROTOCOL_TRACKER_ANNOUNCE_MADDRS=/ip4/PUBLIC_IP/tcp/31338 protocol-tracker
#
# The tracker never trains, so it gets the small CPU build of torch.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.7.1

# --- the project as a wheel (pure Python); only the wheel reaches the final image ---------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY swarm ./swarm
COPY peer ./peer
COPY tracker ./tracker
COPY dhtio ./dhtio
COPY p2pio ./p2pio
COPY launcher ./launcher
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- the tracker -------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG TORCH_VERSION
LABEL org.opencontainers.image.title="protocol-tracker" \
      org.opencontainers.image.description="Tracker of a protocol-swarm run: manifest, bootstrap, status page"

RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
    && echo "torch==${TORCH_VERSION}" > /tmp/torch-constraint.txt \
    && pip install --no-cache-dir --constraint /tmp/torch-constraint.txt /wheels/*.whl \
    && rm /tmp/torch-constraint.txt

COPY docker/healthcheck.py /usr/local/lib/protocol-swarm/healthcheck.py

RUN groupadd --gid 10001 tracker \
    && useradd --create-home --no-log-init --uid 10001 --gid 10001 --shell /usr/sbin/nologin tracker \
    && mkdir -p /data \
    && chown -R tracker:tracker /data

# Every PROTOCOL_TRACKER_<FLAG> variable is the default of protocol-tracker's --<flag>.
# /data holds the manifest (mount yours at /data/manifest.json), the SQLite history and the
# identity that keeps the bootstrap address stable. 8000: HTTP; 31338: the pinned DHT port.
ENV PYTHONUNBUFFERED=1 \
    PROTOCOL_TRACKER_MANIFEST=/data/manifest.json \
    PROTOCOL_TRACKER_HOST=0.0.0.0 \
    PROTOCOL_TRACKER_PORT=8000 \
    PROTOCOL_TRACKER_DB=/data/history.sqlite \
    PROTOCOL_TRACKER_IDENTITY=/data/identity.key \
    PROTOCOL_TRACKER_HOST_MADDRS=/ip4/0.0.0.0/tcp/31338
VOLUME ["/data"]
EXPOSE 8000/tcp 31338/tcp

USER 10001:10001
WORKDIR /home/tracker

HEALTHCHECK --interval=15s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "/usr/local/lib/protocol-swarm/healthcheck.py", "tracker"]

ENTRYPOINT ["protocol-tracker"]
CMD []
