"""`python -m gpt2kit.cli`."""

import sys

from gpt2kit.cli import main

sys.exit(main())
