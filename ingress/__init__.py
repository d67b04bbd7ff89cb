"""The OpenAI-compatible HTTP front end: authenticate, admit, publish to Kafka, relay the stream."""
