"""The flows: transfer learning and the hyperparameter sweep, installed as `prefect_ddp.flows`."""
