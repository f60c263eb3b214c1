"""What the tests share, and the benchmarks and drills import too (as `tests.helpers.<module>`): tiny
random models of each family, prepared-data and draft writers, the fake engines kept for what cannot run
here, a real Prefect service, the fault drills and the bad-input cases."""
