"""Thin wrapper: `python benchmarks/bench_sampler.py [--json PATH] [--vllm-python PATH]`."""

import sys

from jaxrlvr.bench import sampler

if __name__ == "__main__":
    sys.exit(sampler.main(sys.argv[1:]))
