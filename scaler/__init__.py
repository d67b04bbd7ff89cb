"""The scaler: watches each pool's Kafka consumer lag (and, later, sizes the pool from it)."""
