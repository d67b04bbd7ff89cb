"""Running sluice: the `sluice` CLI, the embedded dev stack and deployment assets."""
