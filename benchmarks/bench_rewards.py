"""Thin wrapper: `python benchmarks/bench_rewards.py ...` == `jaxrlvr bench rewards ...`.

See ``jaxrlvr.bench.rewards``.
"""

import sys

from jaxrlvr.bench import rewards

if __name__ == "__main__":
    sys.exit(rewards.main(sys.argv[1:]))
