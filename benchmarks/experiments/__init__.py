"""Draft-quality experiments: one setting changed per training run, each head scored by (simulated or replay) tau."""
