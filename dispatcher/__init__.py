"""The dispatcher: consume a pool's requests from Kafka and place each on a worker's Redis inbox."""
