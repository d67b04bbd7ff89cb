"""What the services share to talk over Redis and Kafka and to reach the stores: clients, the stream
publisher and replay log, answers and dead letters, quota scripts, channel state, model downloads,
health and metrics. It imports the contract and no service."""
