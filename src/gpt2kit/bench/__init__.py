"""`gpt2kit bench`: generation speed against transformers, side by side (run by runner.py, measured by
core.py, timed and judged by timing.py, printed by report.py).

command.py owns the command's options and is light to import (no torch), so the CLI can build its
parser without loading the benchmark. `gpt2kit bench` is the one entry point (the memory worker is
`python -m gpt2kit bench --_memory-worker ...`, so it too parses and reports errors as the CLI does).
"""
