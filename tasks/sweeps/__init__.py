"""Hyperparameter sweeps: Optuna asks, trials train as gangs, the sweep compares them."""
