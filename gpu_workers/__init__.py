"""Workers: read placed requests from a Redis Stream inbox, run them on an engine, stream tokens back."""
