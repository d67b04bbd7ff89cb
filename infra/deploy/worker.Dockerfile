# The GPU worker image: sluice on vLLM's CUDA image (the engine and its CUDA libraries come from there).
FROM vllm/vllm-openai:v0.11.0
WORKDIR /app
COPY pyproject.toml README.md ./
COPY queue_schemas ./queue_schemas
COPY plumbing ./plumbing
COPY openai_api ./openai_api
COPY ingress ./ingress
COPY dispatcher ./dispatcher
COPY gpu_workers ./gpu_workers
COPY scaler ./scaler
COPY infra ./infra
RUN pip install --no-cache-dir . && useradd --uid 10001 --create-home sluice \
    && mkdir -p /models && chown 10001:10001 /models
# Runs as a non-root user with a read-only root filesystem where the platform allows: vLLM, torch and
# Triton write only under $HOME/.cache and /tmp (mounted writable), weights under SLUICE_MODEL_CACHE_DIR.
ENV HOME=/home/sluice VLLM_CACHE_ROOT=/home/sluice/.cache/vllm VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
USER 10001
ENTRYPOINT ["sluice"]
