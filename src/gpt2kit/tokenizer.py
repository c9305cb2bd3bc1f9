"""GPT-2's byte-level BPE tokenizer, exact to OpenAI's ``encoder.py``, run by tiktoken.

The vocabulary is read from local files only (never downloaded): ``encoder.json`` + ``vocab.bpe``
(OpenAI's names) or ``vocab.json`` + ``merges.txt`` (Hugging Face's names); the two pairs have the
same formats. The GPT-2 files ship inside the package (``gpt2kit/vocab``).

tiktoken's BPE merges the adjacent pair whose concatenation has the lowest *token id*, while
``encoder.py`` merges the pair that comes first in the merges list. That is the same BPE only when
the ids of the merge products rise in merge order and every token is a byte or a merge product
(tiktoken's own GPT-2 loader asserts the same), so :meth:`Tokenizer.from_files` checks this and
raises ValueError, naming the file, for files that break it.

Text -> ids: ``Tokenizer.encode``; ids -> text: ``Tokenizer.decode``; ids arriving one at a time
(streaming generation): ``Tokenizer.decoder()`` gives an :class:`IncrementalDecoder` that only
emits whole UTF-8 characters.
"""

from __future__ import annotations

import codecs
import functools
import importlib.resources
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import tiktoken

from gpt2kit._io import atomic_write_text

__all__ = ["GPT2_PATTERN", "EOT_TEXT", "IncrementalDecoder", "Tokenizer", "bytes_to_unicode"]

# Verbatim from OpenAI's encoder.py (contractions are case-sensitive: "'S" is not one). tiktoken's
# r50k_base pattern is an equivalent rewrite; the original costs nothing measurable and leaves no
# doubt about equivalence.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT_TEXT = "<|endoftext|>"
MODEL_MAX_LENGTH = 1024  # GPT-2's n_ctx, written to tokenizer_config.json for transformers

# (vocab, merges) file names a checkpoint directory may hold, in order of preference.
_FILE_PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))
_MERGES_HEADER = "#version: 0.2"
_BATCH_THREADS = 8

# Unicode White_Space, what `\s` means to tiktoken's regex (Python's str.isspace differs: it also
# counts \x1c-\x1f).
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# Whitespace runs at least this long are cut out before tiktoken's regex sees them: its `\s+(?!\S)`
# backtracks recursively and overflows the stack (a Rust panic) somewhere above 200,000 characters.
LONG_WHITESPACE = 4096
# Anchored at a run's start by the lookbehind: without it the search retries inside every shorter
# run, quadratic in the run's length.
_LONG_RUN = re.compile(f"(?<![{_WHITE_SPACE}])[{_WHITE_SPACE}]{{{LONG_WHITESPACE},}}")


def _may_hold_long_run(text: str) -> bool:
    """False only if ``text`` has no whitespace run of LONG_WHITESPACE characters: such a run holds a
    whole aligned block of half that length (str.isspace accepts a superset of White_Space)."""
    half = LONG_WHITESPACE // 2
    return any(text[i : i + half].isspace() for i in range(0, len(text) - half + 1, half))


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """OpenAI's byte -> printable character map, so that BPE files can store bytes as text.

    Printable Latin-1 bytes map to themselves; the other 68 (controls, space, ...) map to
    U+0100 onwards in byte order. That is why a leading space shows up as 'Ġ' in the vocab.
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


@functools.lru_cache(maxsize=1)
def _byte_chars() -> tuple[dict[int, str], frozenset[str]]:
    """str.translate's table from the printable alphabet to the bytes as Latin-1 characters, and
    the alphabet itself (translate and encode run in C: building the 50k-token vocabulary takes
    milliseconds instead of most of a second)."""
    table = {ord(c): chr(b) for c, b in _unicode_to_bytes().items()}
    return table, frozenset(_unicode_to_bytes())


def _token_bytes(token: str, path: Path, where: str) -> bytes:
    table, alphabet = _byte_chars()
    if not alphabet.issuperset(token):
        bad = next(c for c in token if c not in alphabet)
        raise ValueError(
            f"{path}: {where}: token {token!r} has character {bad!r} that is not in GPT-2's "
            "byte-to-unicode alphabet (is this a byte-level BPE file?)"
        )
    return token.translate(table).encode("latin-1")


def _read_vocab(path: Path) -> dict[str, int]:
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON vocabulary: {e}") from None
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError(f"{path}: expected a non-empty JSON object mapping token -> id")
    for token, i in vocab.items():
        # bool is an int subclass; a vocab with true/false ids is broken, not 0/1.
        if type(i) is not int:
            raise ValueError(f"{path}: token {token!r} has id {i!r}, expected an int")
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        missing = sorted(set(range(len(ids))) - set(ids))[:5]
        raise ValueError(
            f"{path}: token ids must be exactly 0..{len(ids) - 1} with no repeats "
            f"(first missing ids: {missing})"
        )
    if EOT_TEXT not in vocab:
        raise ValueError(f"{path}: the vocabulary has no {EOT_TEXT!r} token")
    return vocab


def _read_merges(path: Path) -> list[tuple[str, str]]:
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text: {e}") from None
    merges = []
    for lineno, line in enumerate(lines, start=1):
        if lineno == 1 and line.startswith("#version"):
            continue  # the header both OpenAI and HF write
        if not line:
            continue  # the trailing newline
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ValueError(f"{path}: line {lineno} is {line!r}, expected two tokens separated by one space")
        merges.append((parts[0], parts[1]))
    return merges


def _mergeable_ranks(
    vocab: dict[str, int], merges: list[tuple[str, str]], vocab_path: Path, merges_path: Path
) -> dict[bytes, int]:
    """Token bytes -> id for every non-special token, checked against the merge order (see module doc)."""
    ranks: dict[bytes, int] = {}
    token_bytes: dict[str, bytes] = {}
    for token, i in vocab.items():
        if token == EOT_TEXT:
            continue
        token_bytes[token] = b = _token_bytes(token, vocab_path, "vocabulary")
        ranks[b] = i
    missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
    if missing_bytes:
        raise ValueError(f"{vocab_path}: no token for the single bytes {missing_bytes[:8]}")

    last_rank = -1
    for lineno, (a, b) in enumerate(merges, start=1):
        where = f"merge {lineno} ({a} {b})"
        left, right = token_bytes.get(a), token_bytes.get(b)
        if left is None or right is None:  # not vocabulary tokens: say why (alphabet, or absent)
            left, right = _token_bytes(a, merges_path, where), _token_bytes(b, merges_path, where)
        for part, part_bytes in ((a, left), (b, right)):
            if part_bytes not in ranks:
                raise ValueError(f"{merges_path}: {where}: {part!r} is not in {vocab_path}")
        rank = ranks.get(left + right)
        if rank is None:
            raise ValueError(f"{merges_path}: {where}: the merged token {a + b!r} is not in {vocab_path}")
        if rank <= last_rank:
            raise ValueError(
                f"{merges_path}: {where}: merged token {a + b!r} has id {rank} in {vocab_path}, not above "
                f"the previous merge's id {last_rank}; ids must follow merge order for tiktoken to be exact"
            )
        last_rank = rank
    if len(ranks) != 256 + len(merges):
        raise ValueError(
            f"{vocab_path} has {len(ranks)} non-special tokens but {merges_path} makes "
            f"256 bytes + {len(merges)} merges = {256 + len(merges)}; the files do not belong together"
        )
    return ranks


def _as_id_list(ids: Iterable[int] | int) -> list[int]:
    if isinstance(ids, int):
        return [ids]
    tolist = getattr(ids, "tolist", None)  # numpy arrays and torch tensors, without importing either
    if tolist is not None:
        ids = tolist()
        return [ids] if isinstance(ids, int) else ids
    return list(ids)


class Tokenizer:
    """GPT-2 byte-level BPE. Build with :meth:`default`, :meth:`from_dir` or :meth:`from_files`."""

    def __init__(
        self,
        vocab: dict[str, int],
        merges: list[tuple[str, str]],
        *,
        vocab_path: Path | None = None,
        merges_path: Path | None = None,
    ) -> None:
        self.vocab_path = vocab_path
        self.merges_path = merges_path
        label_v = vocab_path or Path("<vocab>")
        label_m = merges_path or Path("<merges>")
        ranks = _mergeable_ranks(vocab, merges, label_v, label_m)
        self._vocab = vocab  # kept (with the merges) so save() can write them back verbatim
        self._merges = merges
        self.eot_text = EOT_TEXT
        self.eot_token: int = vocab[EOT_TEXT]
        self.n_vocab: int = len(vocab)
        self._enc = tiktoken.Encoding(
            name=f"gpt2kit:{label_v}",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={EOT_TEXT: self.eot_token},
            explicit_n_vocab=self.n_vocab,
        )

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_files(cls, vocab_path: str | os.PathLike[str], merges_path: str | os.PathLike[str]) -> Tokenizer:
        """Build from a vocab (encoder.json / vocab.json) and a merges (vocab.bpe / merges.txt) file."""
        vocab_path, merges_path = Path(vocab_path), Path(merges_path)
        return cls(
            _read_vocab(vocab_path), _read_merges(merges_path), vocab_path=vocab_path, merges_path=merges_path
        )

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def default() -> Tokenizer:
        """The GPT-2 tokenizer from the packaged files; built once and shared."""
        vocab = importlib.resources.files("gpt2kit") / "vocab"
        # as_file gives a real path even for zipped installs; the files are read before it exits.
        with (
            importlib.resources.as_file(vocab / "encoder.json") as v,
            importlib.resources.as_file(vocab / "vocab.bpe") as m,
        ):
            return Tokenizer.from_files(v, m)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """The directory's own vocab/merges files if it has them (HF names first), else :meth:`default`."""
        path = Path(path)
        if not path.is_dir():
            raise NotADirectoryError(f"{path} is not a directory")
        for vocab_name, merges_name in _FILE_PAIRS:
            vocab_file, merges_file = path / vocab_name, path / merges_name
            if vocab_file.is_file() and merges_file.is_file():
                return cls.from_files(vocab_file, merges_file)
            if vocab_file.is_file() or merges_file.is_file():
                # Half a pair is a broken checkpoint; silently using the stock vocab would hide it.
                have, lacks = (vocab_name, merges_name) if vocab_file.is_file() else (merges_name, vocab_name)
                raise ValueError(f"{path} has {have} but not {lacks}")
        return cls.default()

    # --- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids for ``text``. ``<|endoftext|>`` in the text is plain text unless ``allow_special``.

        Any text is accepted: whitespace runs of any length give GPT-2's ids (see :meth:`_encode_long`).
        """
        if not _may_hold_long_run(text) or _LONG_RUN.search(text) is None:
            return self._encode_regex(text, allow_special)
        return self._encode_long(text, allow_special)

    def _encode_regex(self, text: str, allow_special: bool) -> list[int]:
        try:
            if allow_special:
                return self._enc.encode(text, allowed_special="all")
            return self._enc.encode_ordinary(text)
        except BaseException as e:  # tiktoken's Rust panics arrive as a BaseException (pyo3's PanicException)
            if isinstance(e, Exception) or type(e).__name__ != "PanicException":
                raise
            raise ValueError(f"tiktoken failed on a text of {len(text):,} characters: {e}") from None

    def _encode_long(self, text: str, allow_special: bool) -> list[int]:
        """:meth:`encode` with each long whitespace run tokenized apart from the regex.

        GPT-2's pattern splits a maximal whitespace run W the same way wherever it stands: when a
        character that is not whitespace follows, ``\\s+(?!\\S)`` takes W[:-1] as one piece and W's last
        character starts the next piece (`` ?\\p{L}+`` and co. take a space with the word after it; any
        other whitespace stands alone); at the end of the text (or before an allowed special token)
        W is one piece. No piece ever joins W to the text before it. So the text before W, the piece
        and the text from the cut on are tokenized separately, the piece by tiktoken's BPE directly
        (``_encode_single_piece``, the function its encoder applies to every regex piece): the ids
        are GPT-2's by construction, which tests check against the unsplit encoding and OpenAI's
        encoder.py.
        """
        ids: list[int] = []
        pos = 0
        for run in _LONG_RUN.finditer(text):
            start, end = run.span()
            followed = end < len(text) and not (allow_special and text.startswith(EOT_TEXT, end))
            cut = end - 1 if followed else end
            ids += self._encode_regex(text[pos:start], allow_special)
            ids += self._enc._encode_single_piece(text[start:cut].encode("utf-8"))
            pos = cut
        ids += self._encode_regex(text[pos:], allow_special)
        return ids

    def encode_batch(self, texts: Sequence[str], *, allow_special: bool = False) -> list[list[int]]:
        """:meth:`encode` for many texts at once, on tiktoken's thread pool."""
        texts = list(texts)
        if any(_may_hold_long_run(t) for t in texts):
            return [self.encode(t, allow_special=allow_special) for t in texts]
        if allow_special:
            return self._enc.encode_batch(texts, num_threads=_BATCH_THREADS, allowed_special="all")
        return self._enc.encode_ordinary_batch(texts, num_threads=_BATCH_THREADS)

    def decode_bytes(self, ids: Iterable[int] | int) -> bytes:
        """The raw bytes of the tokens; may end in (or contain) part of a UTF-8 character."""
        ids = _as_id_list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.n_vocab):
            n = self.n_vocab
            bad = next(i for i in ids if not 0 <= i < n)
            raise ValueError(f"token id {bad} is outside the vocabulary (n_vocab {n}: ids 0..{n - 1})")
        return self._enc.decode_bytes(ids)

    def decode(self, ids: Iterable[int] | int) -> str:
        """Text for the ids; bytes that are not valid UTF-8 (a character cut in half) become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decoder(self) -> IncrementalDecoder:
        """A fresh streaming decoder (see :class:`IncrementalDecoder`)."""
        return IncrementalDecoder(self)

    # --- saving -------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike[str]) -> tuple[Path, ...]:
        """Write vocab.json, merges.txt, tokenizer_config.json and special_tokens_map.json.

        The formats are the ones transformers' GPT2Tokenizer writes and reads, so
        ``GPT2TokenizerFast.from_pretrained(directory)`` gives the same ids as this tokenizer.
        Each file is replaced atomically. Returns the paths written.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        eot = self.eot_text
        files = {
            "vocab.json": json.dumps(self._vocab, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
            "merges.txt": _MERGES_HEADER + "\n" + "".join(f"{a} {b}\n" for a, b in self._merges),
            "tokenizer_config.json": _json(
                {
                    "add_bos_token": False,
                    "add_prefix_space": False,
                    "added_tokens_decoder": {
                        str(self.eot_token): {
                            "content": eot,
                            "lstrip": False,
                            "normalized": True,
                            "rstrip": False,
                            "single_word": False,
                            "special": True,
                        }
                    },
                    "bos_token": eot,
                    # False so HF's decode returns the same text as ours (no " ." -> "." cleanup).
                    "clean_up_tokenization_spaces": False,
                    "eos_token": eot,
                    "errors": "replace",
                    "model_max_length": MODEL_MAX_LENGTH,
                    "pad_token": None,
                    "tokenizer_class": "GPT2Tokenizer",
                    "unk_token": eot,
                }
            ),
            "special_tokens_map.json": _json({"bos_token": eot, "eos_token": eot, "unk_token": eot}),
        }
        paths = []
        for name, text in files.items():
            atomic_write_text(directory / name, text)
            paths.append(directory / name)
        return tuple(paths)

    def __repr__(self) -> str:
        return f"Tokenizer(n_vocab={self.n_vocab}, vocab_path={str(self.vocab_path)!r})"


def _json(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


class IncrementalDecoder:
    """Turns ids arriving one (or a few) at a time into text, one whole character at a time.

    A token can end in the middle of a UTF-8 character (emoji and CJK are often split over byte
    tokens), so :meth:`feed` holds back an incomplete trailing sequence until the rest arrives.
    Bytes that can never become valid UTF-8 are emitted as U+FFFD at once rather than held.
    Concatenating every :meth:`feed` result and :meth:`flush` equals ``Tokenizer.decode`` of all ids.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: list[int] | int) -> str:
        """Decode more ids; returns the complete characters they finish (possibly '')."""
        return self._utf8.decode(self._tokenizer.decode_bytes(ids), final=False)

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character becomes U+FFFD); feed may follow."""
        return self._utf8.decode(b"", final=True)  # final=True also empties the codec's buffer
