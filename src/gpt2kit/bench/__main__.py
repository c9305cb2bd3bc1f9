import sys

from gpt2kit.bench import main

sys.exit(main())
