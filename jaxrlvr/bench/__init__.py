"""Benchmarks runnable as `jaxrlvr bench NAME --json PATH`; each module has `main(argv)`."""
