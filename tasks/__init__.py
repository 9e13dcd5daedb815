"""Everything the flows run, by concern (docs/architecture.md, "Layers"), installed as `prefect_ddp.tasks`."""
