"""Generation speed, gpt2kit vs transformers, side by side: `python benchmarks/bench_generate.py [--quick]`.

The same as `gpt2kit bench`; the measurements live in gpt2kit/bench.py (see its docstring and
docs/benchmarks.md for what is measured and how).
"""

import sys

from gpt2kit.bench import main

if __name__ == "__main__":
    sys.exit(main())
