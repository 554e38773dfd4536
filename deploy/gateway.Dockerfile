# syntax=docker/dockerfile:1
# The session-affine gateway: Debian's nginx (1.22, with grpc_pass and consistent hashing),
# running unprivileged. Its configuration comes from deploy/k8s/gateway.yaml's ConfigMap,
# mounted at /etc/nginx/edgespec (the image's copy of deploy/nginx/ is the default).
#   docker build -f deploy/gateway.Dockerfile -t edgespec-gateway .
# Pin the base by digest in production: DEBIAN_IMAGE=debian:bookworm-slim@sha256:...
ARG DEBIAN_IMAGE=debian:bookworm-slim

FROM ${DEBIAN_IMAGE}
ARG NGINX_VERSION=1.22.1-9+deb12u11
RUN apt-get update \
    && apt-get install -y --no-install-recommends "nginx=${NGINX_VERSION}" \
        "nginx-common=${NGINX_VERSION}" \
    && rm -rf /var/lib/apt/lists/* \
    && rm -f /etc/nginx/sites-enabled/default \
    && useradd --system --no-create-home --uid 10101 --user-group gateway
COPY deploy/nginx/nginx.conf /etc/nginx/nginx.conf
COPY deploy/nginx/gateway.conf deploy/nginx/routes.conf /etc/nginx/edgespec/
USER 10101:10101
EXPOSE 8080 8443 8081
STOPSIGNAL SIGQUIT
ENTRYPOINT ["nginx", "-e", "/dev/stderr", "-g", "daemon off;"]
