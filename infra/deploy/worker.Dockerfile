# The GPU worker image: sluice on vLLM's CUDA image (the engine and its CUDA libraries come from there).
FROM vllm/vllm-openai:v0.11.0
WORKDIR /app
COPY pyproject.toml README.md ./
COPY queue_schemas ./queue_schemas
COPY ingress ./ingress
COPY dispatcher ./dispatcher
COPY gpu_workers ./gpu_workers
COPY scaler ./scaler
COPY infra ./infra
RUN pip install --no-cache-dir .
ENTRYPOINT ["sluice"]
