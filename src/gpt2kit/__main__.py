"""`python -m gpt2kit` (and `torchrun -m gpt2kit train ...`)."""

import sys

from gpt2kit.cli import main

sys.exit(main())
