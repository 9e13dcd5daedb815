"""`python -m prefect_ddp demo|serve`: the same as the `prefect-ddp` command."""

from prefect_ddp.cli import main

main()
