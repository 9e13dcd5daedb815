"""Ways to run the flows: the local demo, local services it needs, and deployments."""
