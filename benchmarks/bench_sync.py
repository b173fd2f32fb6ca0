"""Thin wrapper: `python benchmarks/bench_sync.py ...` == `jaxrlvr bench sync ...`.

See ``jaxrlvr.bench.sync``.
"""

import sys

from jaxrlvr.bench import sync

if __name__ == "__main__":
    sys.exit(sync.main(sys.argv[1:]))
