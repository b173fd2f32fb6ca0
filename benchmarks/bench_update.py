"""GRPO update throughput, jaxrlvr vs a PyTorch reference: see ``jaxrlvr.bench.update``.

Usage: python benchmarks/bench_update.py [--tiny] [--json PATH] [--repeats N]
"""

import sys

from jaxrlvr.bench import update

if __name__ == "__main__":
    sys.exit(update.main(sys.argv[1:]))
