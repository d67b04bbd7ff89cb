"""OpenAI's Batch API over HTTP: /v1/files and /v1/batches, the keeper that runs batches, their files
and the Redis protocol of a batch."""
