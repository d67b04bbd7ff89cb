"""Benchmarks and simulations; each prints its figures."""
