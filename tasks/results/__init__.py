"""What a run leaves: its folder, metrics, report and the promoted model."""
