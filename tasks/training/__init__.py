"""The transfer-learning recipe that runs on every rank, and the model it keeps."""
