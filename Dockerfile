# The flotilla binary in a slim image. Build from the repository root:
#
#   docker build -t flotilla:latest .
#
# Runs as UID/GID 65532 (as deploy/k8s expects), models and layout caches
# in the volume /var/cache/flotilla. The default command serves the default
# model (fetched into the volume on first start) with the cluster config
# mounted at /etc/flotilla/cluster.toml (your tenants and keys):
#
#   docker run -p 8000:8000 -v flotilla-cache:/var/cache/flotilla \
#     -v $PWD/my-cluster.toml:/etc/flotilla/cluster.toml:ro flotilla:latest
#
# Other models or flags replace the command, e.g. `serve --host 0.0.0.0
# --config /etc/flotilla/cluster.toml --model qwen2.5-coder-1.5b`; a cluster
# node runs `node --config /etc/flotilla/cluster.toml --name NODE`.

# Build stage: Rust and a C compiler (mimalloc), nothing else.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p flotilla \
    && install -m 0755 target/release/flotilla /usr/local/bin/flotilla

# Runtime stage: the binary, CA certificates (model downloads over HTTPS),
# an unprivileged user and a cache directory it owns.
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 65532 flotilla \
    && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin flotilla \
    && mkdir -p /var/cache/flotilla /etc/flotilla \
    && chown 65532:65532 /var/cache/flotilla
COPY --from=build /usr/local/bin/flotilla /usr/local/bin/flotilla
ENV FLOTILLA_CACHE_DIR=/var/cache/flotilla \
    FLOTILLA_LOG=info
VOLUME ["/var/cache/flotilla"]
USER 65532:65532
# HTTP API (serve, router), QUIC between nodes, an engine node's metrics.
EXPOSE 8000 7400/udp 9400
ENTRYPOINT ["flotilla"]
CMD ["serve", "--host", "0.0.0.0", "--config", "/etc/flotilla/cluster.toml"]
