"""What the command line runs on top of the public API: the self-check and the benchmarks."""
