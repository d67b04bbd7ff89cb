"""A discrete-event simulator of a fleet of replicas, running the project's placement and scaling code."""
