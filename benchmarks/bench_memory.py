"""Per-device memory of the 1.5B GRPO update (compiled, never run): see ``jaxrlvr.bench.memory``.

Usage: python benchmarks/bench_memory.py [--fsdp 1,8] [--chunk off,on] [--packing off,on]
[--tiny] [--json PATH]
"""

import sys

from jaxrlvr.bench import memory

if __name__ == "__main__":
    sys.exit(memory.main(sys.argv[1:]))
