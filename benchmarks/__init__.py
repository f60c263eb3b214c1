"""Scripts that print measured figures, each run as a module from the repo root (`python -m benchmarks.speed.x`)."""
