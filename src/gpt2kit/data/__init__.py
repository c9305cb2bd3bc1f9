"""Token shards for training, in llm.c's GPT-2 shard format.

A shard is a 1024-byte header of 256 little-endian int32 (magic 20240520, version 1, token count,
then zeros) followed by the tokens as little-endian uint16. This is what llm.c's dev/data scripts
and modded-nanogpt write for FineWeb, so their shards load here and ours load there.

    prepare(["corpus/"], "shards/")          # text/.jsonl -> val_000000.bin, train_000000.bin, ...
    loader = ShardLoader("shards/", "train", batch_size=8, seq_len=1024, rank=r, world_size=W)
    x, y = loader.next_batch()               # (B, T) int64, y is x shifted left by one

Legend: B batch size, T sequence length, W world size (number of data-parallel ranks).

This `__init__` only re-exports: shard.py is the format (write, validate, read, find, the vocabulary
check), corpus.py is `prepare` (documents.py its inputs, workers.py its tokenizer processes),
loaders.py the two batch loaders.
"""

from gpt2kit.data.corpus import DEFAULT_SHUFFLE_SEED, PrepareSummary, prepare
from gpt2kit.data.loaders import RandomWindowLoader, ShardLoader
from gpt2kit.data.shard import (
    HEADER_BYTES,
    HEADER_INTS,
    MAGIC,
    MAX_SHARD_TOKENS,
    TOKEN_DTYPE,
    VERSION,
    ShardError,
    check_vocab,
    find_shards,
    first_token_at_least,
    read_shard,
    write_shard,
)
from gpt2kit.data.workers import WorkerDied

__all__ = ["DEFAULT_SHUFFLE_SEED", "HEADER_BYTES", "HEADER_INTS", "MAGIC", "MAX_SHARD_TOKENS", "TOKEN_DTYPE",
           "VERSION", "PrepareSummary", "RandomWindowLoader", "ShardError", "ShardLoader", "WorkerDied",
           "check_vocab", "find_shards", "first_token_at_least", "prepare", "read_shard", "write_shard"]
