# The specserve image for KubeRay (deploy/kuberay/*.yaml): Python 3.11, specserve installed the way the README
# does (install.sh), the embedded model converted at build time so pods start without it.
#   docker build -t specserve:0.1.0 .
# install.sh pins torch==2.13.0; from PyPI that is the CUDA build (GPU pods). For a smaller CPU-only image:
#   docker build --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu -t specserve:0.1.0-cpu .
FROM python:3.11-slim

ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    SPECSERVE_CACHE=/opt/specserve/cache
# wget: KubeRay's default head probes call it
RUN apt-get update && apt-get install -y --no-install-recommends wget && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/specserve
COPY pyproject.toml install.sh README.md ./
COPY protos ./protos
COPY services ./services
COPY cluster ./cluster
RUN bash install.sh \
 && python3 -c "from specserve.models import embedded; embedded.converted_dir(embedded.embedded_gguf_path())"

# HTTP (OpenAI API), gRPC (specserve.v1.Generator), Prometheus metrics, Ray dashboard, GCS, Ray client
EXPOSE 8000 9000 8080 8265 6379 10001
CMD ["specserve", "serve", "--host", "0.0.0.0"]
