"""Scoring images with a kept model: the batch-predict flow's tasks."""
