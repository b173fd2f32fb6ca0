"""Forward tokens/s, jaxrlvr vs transformers (torch CPU): see ``jaxrlvr.bench.forward``.

Usage: python benchmarks/bench_forward.py [--shapes tiny,small] [--repeats N] [--json PATH]
"""

import sys

from jaxrlvr.bench import forward

if __name__ == "__main__":
    sys.exit(forward.main(sys.argv[1:]))
