"""Ways to run the flows: the local demo, the services it needs, and the laptop deployments.

Installed as `prefect_ddp.deployments`; `prefect-ddp demo` and `prefect-ddp serve` run them.
"""
