# The specserve image for KubeRay (deploy/kuberay/*.yaml): Python 3.11, specserve installed the way the README
# does (install.sh), the embedded model's config and tokenizer read at build time so pods start without it.
#   docker build -t specserve:0.1.0 .                                    GPU pods: torch's CUDA build
#   docker build --build-arg TORCH=--cpu -t specserve:0.1.0-cpu .       CPU-only pods: a smaller image
# Run alone, it listens on every interface and so asks for a key: docker run -e SPECSERVE_API_KEY=... -p 8000:8000
FROM python:3.11-slim

ARG TORCH=--cuda
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    SPECSERVE_CACHE=/opt/specserve/cache
# wget: KubeRay's default head probes call it
RUN apt-get update && apt-get install -y --no-install-recommends wget && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/specserve
COPY pyproject.toml install.sh README.md ./
COPY protos ./protos
COPY services ./services
COPY cluster ./cluster
RUN bash install.sh ${TORCH} \
 && python3 -c "from specserve.models.formats.loading import resolve_model_path; resolve_model_path('embedded')"

# HTTP (OpenAI API), gRPC (specserve.v1.Generator), Prometheus metrics, Ray dashboard, GCS, Ray client
EXPOSE 8000 9000 8080 8265 6379 10001
CMD ["specserve", "serve", "--host", "0.0.0.0"]
