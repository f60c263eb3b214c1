"""Speed benchmarks: throughput and memory of eagle3's own code against a baseline measured in the same run."""
