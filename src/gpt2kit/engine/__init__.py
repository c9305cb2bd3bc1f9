"""The generation engine, in three parts as vLLM keeps them apart: the scheduler (scheduler.py:
:class:`Engine`, rows joining and leaving the running batch per iteration, and :class:`EngineLoop`
in loop.py, which runs it in a worker thread for the server), the batch's cache geometry
(batch_cache.py: :class:`SlotPool`, a slot of its own for each row's keys and values) and output
processing (outputs.py: finish reasons, log-probs; text.py: text with stop strings held back).
rows.py holds the row, its typed routing key, its one event shape and two declared protocols: a row
group's (rows that run together: a beam search, beam_rows.py) and the engine's (EngineInterface, what
EngineLoop, the server and gpt2kit.generation type against; Engine satisfies it). speculate.py holds
the speculating rows the scheduler steps beside its others (per-row proposers: prompt lookup or a
draft model, verified in each row's own slot; drafts.py the pure rule). checks.py is the one check of
a request's decoding settings (for gpt2kit.generation, the server and the row makers). The generator
API over it is gpt2kit.generation.
"""

from gpt2kit.engine.batch_cache import SlotPool
from gpt2kit.engine.loop import EngineLoop
from gpt2kit.engine.rows import EngineInterface, Row, RowEvent, RowGroup, RowKey
from gpt2kit.engine.scheduler import Engine
from gpt2kit.sampling.sampler import next_tokens

__all__ = ["Engine", "EngineInterface", "EngineLoop", "Row", "RowEvent", "RowGroup", "RowKey", "SlotPool",
           "next_tokens"]
