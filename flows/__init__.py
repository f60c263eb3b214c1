"""Prefect flows: the pipeline (stages in order) and, later, the nightly retrain."""
