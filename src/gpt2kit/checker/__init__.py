"""`gpt2kit check`: a learner's own GPT-2 compared with gpt2kit's, stage by stage, with a diagnosis of
the first stage that differs (docs/check.md).

learner.py imports the learner's file and calls their model; mapping.py puts the reference weights
into it by name; stages.py reads both models' stages by forward hooks and compares them; variants.py
holds GPT-2's pieces with the common mistakes as switches, which diagnose.py and probes.py (the cache
and the LayerNorm epsilon) use to name a mistake; report.py is what comes back; run.py ties them.
"""

from gpt2kit.checker.learner import LearnerError
from gpt2kit.checker.report import CheckReport
from gpt2kit.checker.run import check

__all__ = ["CheckReport", "LearnerError", "check"]
