"""Helpers for the tests: services and fronts they start, scripts they run as processes, the UI driver."""
