"""Model definitions shared by examples, tests, benchmarks and the estimator."""
