# kvmesh: one image for the router, prefill and decode services.
# Build: docker build -t kvmesh .    Run: docker compose up
# No protoc is needed (protox compiles the protos in Rust; etcd-client's
# build gets a committed descriptor set through scripts/protoc, see
# .cargo/config.toml), and nothing is fetched at run time: the default model
# is fetched with pip at build time and baked into the image.
# docker-compose.etcd.yml runs the same image with membership through etcd.

# CUDA=1 (docker-compose.gpu.yml) adds the pinned NVRTC and cuBLAS wheels'
# libraries (CUDA 13.0, the GPU machines' driver generation), which kvmesh
# opens at run time for `--device cuda`; the driver comes from the host
# (NVIDIA Container Toolkit). The default image has none of it and runs on
# the CPU.
ARG CUDA=0
# The base images, as build arguments so that a machine without an image
# registry can name its own (scripts/compose-check.sh builds a Debian
# bookworm base with debootstrap); the defaults are the registry's.
ARG BUILD_BASE=rust:1-bookworm
ARG RUNTIME_BASE=debian:bookworm-slim
# The stage the runtime stage copies the binary, the model and the CUDA
# libraries from: `build` compiles them here. Any image with the same three
# paths (/src/target/release/kvmesh, /models/..., /cuda/lib) can stand in:
# scripts/compose-check.sh passes one holding the binary built on the host.
# With BuildKit (the default builder) the `build` stage then never runs.
ARG KVMESH_FROM=build

FROM ${BUILD_BASE} AS build
ARG CUDA
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release -p kvmesh-cli \
 && KVMESH_HOME=/models ./target/release/kvmesh fetch-model
RUN mkdir -p /cuda/lib && if [ "$CUDA" = 1 ]; then \
      pip install --break-system-packages --no-deps --target /cuda/py \
        nvidia-cuda-nvrtc==13.0.88 nvidia-cublas==13.0.2.14 \
      && cp -a /cuda/py/nvidia/cu13/lib/. /cuda/lib/; fi

FROM ${KVMESH_FROM} AS kvmesh

FROM ${RUNTIME_BASE}
# libucp for `transport: ucx` (opened at run time; the other transports
# do not need it).
RUN apt-get update && apt-get install -y --no-install-recommends libucx0 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 kvmesh
COPY --from=kvmesh /src/target/release/kvmesh /usr/local/bin/kvmesh
COPY --from=kvmesh /models/SmolLM2-135M-Instruct.Q4_1.gguf /models/SmolLM2-135M-Instruct.Q4_1.gguf
# Empty unless CUDA=1; searched first by kvmesh's CUDA loader.
COPY --from=kvmesh /cuda/lib /opt/kvmesh/cuda/lib
ENV KVMESH_CUDA_LIB_DIR=/opt/kvmesh/cuda/lib
COPY deploy/mesh.yaml /etc/kvmesh/mesh.yaml
# The mesh secret is never baked in: docker-compose.yml mounts it.
USER kvmesh
ENTRYPOINT ["kvmesh"]
