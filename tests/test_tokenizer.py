"""gpt2kit.tokenizer against three references built here from the same files, with no network:

* OpenAI's encoder.py, ported verbatim below (the definition of GPT-2's BPE),
* tiktoken's own GPT-2 loader (``data_gym_to_mergeable_bpe_ranks`` + ``r50k_pat_str``) on local paths,
* transformers' GPT2Tokenizer(Fast), loaded from a directory holding copies of the files.

Token ids are compared exactly (no tolerance): one differing id is a different tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import shutil
from functools import lru_cache
from pathlib import Path

import pytest
import regex
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str

from gpt2kit.checkpoint import load_tokenizer
from gpt2kit.tokenizer import LONG_WHITESPACE, IncrementalDecoder, Tokenizer

DATA = Path(str(importlib.resources.files("gpt2kit") / "vocab"))
ENCODER_JSON, VOCAB_BPE = DATA / "encoder.json", DATA / "vocab.bpe"
ENCODER_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
EOT = "<|endoftext|>"

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "naïve café résumé Ångström Straße ÆØÅ",
    # emoji, incl. ZWJ family, skin tone, flag, keycap
    "😀😃 🎉 👨‍👩‍👧‍👦 👍🏽 🇺🇸🇯🇵 1️⃣ 🏳️‍🌈",
    # CJK, Korean, Thai, Devanagari
    "你好，世界！ 日本語のテキスト、カタカナ。 안녕하세요 สวัสดีครับ नमस्ते दुनिया",
    # right-to-left, mixed with LTR and digits
    "مرحبا بالعالم 123 שלום עולם! abc مرحبا",
    # combining marks (decomposed accents, stacked marks)
    "e\u0301 a\u0300\u0301\u0302 Z\u0351\u0352\u0353a\u0354lgo n\u0303",
    # runs of spaces and tabs, leading and trailing whitespace
    "a  b   c    d",
    "    leading spaces",
    "trailing spaces   ",
    "\t\tx\t \ty  \t",
    "   \t   ",
    # line endings and newline runs
    "line1\r\nline2\r\n\r\n",
    "\n",
    "\n\n\n",
    "para one.\n\n\npara two.\n \n  \nend\n",
    # source code
    'def f(x: int) -> int:\n    """Doc."""\n    if x > 0:\n        return x ** 2  # square\n    return -x\n',
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "x+=1;y=x<<2|0xFF&~z; // a->b != c->d",
    # contractions, every case (GPT-2's are case-sensitive)
    "it's It'S IT'S it'S we'll We'Ll WE'LL we'lL they're They'Re THEY'RE I've I'VE I'Ve",
    "I'm I'M he'd HE'D don't DON'T 's 'S 't 'T 're 'RE 've 'VE 'm 'M 'll 'LL 'd 'D",
    "''s'' 'ss 'sss o'clock rock'n'roll ' ' '",
    # an upper-case contraction followed by letters splits differently if matched case-blind
    "'Sam 'TIS IT'SOK 'Dave 'Mark 'LLama 'REally 'VEry don'TWORRY 'sam 'tis 'llama",
    # numbers
    "123 4567 89012345 3.14159 1,000,000 -42 0x1F 1e-10 2024-01-01 ١٢٣ ½ ² Ⅻ",
    # the end-of-text marker inside ordinary text
    "Hello<|endoftext|>world",
    "<|endoftext|>",
    " <|endoftext|> a<|endoftext|><|endoftext|>b <|endoftext <|endoftext|",
    # unusual whitespace and controls
    "a\u00a0b\u3000c\u2028d\u2029e\u0085f\x0b\x0cg",
    "\x00\x01\x1b[31mred\x1b[0m\x7f",
    "zero\u200bwidth\ufeffbom",
    "a" * 500 + " " + "9" * 200,
    "Hello,   world!!!  How's it going?\n\tFine.   ",
]
PLAIN_CORPUS = [t for t in CORPUS if EOT not in t]
EOT_CORPUS = [t for t in CORPUS if EOT in t]


# --- references -------------------------------------------------------------------------------


class OpenAIEncoder:
    """OpenAI's gpt-2/src/encoder.py (encode half), ported to Python 3 verbatim in substance."""

    def __init__(self, encoder_path: Path, bpe_path: Path) -> None:
        self.encoder = json.loads(encoder_path.read_text(encoding="utf-8"))
        merges = bpe_path.read_text(encoding="utf-8").split("\n")[1:-1]
        self.bpe_ranks = {tuple(m.split()): i for i, m in enumerate(merges)}
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
        bs += list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        self.byte_encoder = dict(zip(bs, map(chr, cs), strict=True))
        self.pat = regex.compile(
            r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
        )
        self.bpe = lru_cache(maxsize=None)(self._bpe)

    def _bpe(self, token: str) -> str:
        word = tuple(token)
        while len(word) > 1:
            pairs = set(zip(word, word[1:], strict=False))
            bigram = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word: list[str] = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new_word.extend(word[i:])
                    break
                new_word.extend(word[i:j])
                i = j
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
        return " ".join(word)

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in regex.findall(self.pat, text):
            piece = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(piece).split(" "))
        return ids


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.default()


@pytest.fixture(scope="module")
def openai_ref() -> OpenAIEncoder:
    return OpenAIEncoder(ENCODER_JSON, VOCAB_BPE)


@pytest.fixture(scope="module")
def tiktoken_ref() -> tiktoken.Encoding:
    # tiktoken's GPT-2 recipe (tiktoken_ext.openai_public.gpt2) with local paths instead of URLs;
    # an empty cache dir makes read_file_cached read the files directly and write nothing.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(VOCAB_BPE),
            encoder_json_file=str(ENCODER_JSON),
            vocab_bpe_hash=VOCAB_BPE_SHA256,
            encoder_json_hash=ENCODER_SHA256,
        )
    return tiktoken.Encoding(
        name="gpt2-reference",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={EOT: 50256},
        explicit_n_vocab=50257,
    )


def _hf_classes() -> list[type]:
    transformers = pytest.importorskip("transformers")
    # In transformers 5 both names are the same tokenizers-backed class; in 4.x GPT2Tokenizer is the
    # slow pure-Python one, a second independent reference.
    return list(dict.fromkeys([transformers.GPT2TokenizerFast, transformers.GPT2Tokenizer]))


def _hf_from_files(cls: type, vocab: Path, merges: Path, tmp: Path):
    # Copies under the HF names + from_pretrained works on transformers 4 and 5 alike. (In 5.x
    # GPT2TokenizerFast(vocab_file=..., merges_file=...) silently builds an *empty* tokenizer.)
    tmp.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(vocab, tmp / "vocab.json")
    shutil.copyfile(merges, tmp / "merges.txt")
    return cls.from_pretrained(str(tmp))


@pytest.fixture(scope="module")
def hf_refs(tmp_path_factory: pytest.TempPathFactory) -> list:
    tmp = tmp_path_factory.mktemp("hf")
    return [_hf_from_files(cls, ENCODER_JSON, VOCAB_BPE, tmp / cls.__name__) for cls in _hf_classes()]


def hf_encode_plain(hf, text: str) -> list[int]:
    """HF ids with <|endoftext|> treated as ordinary text (HF's default matches it as special)."""
    ids = hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert EOT not in text or 50256 not in ids, "split_special_tokens was ignored by this transformers"
    return ids


# --- files --------------------------------------------------------------------------------------


def test_packaged_files_are_openai_gpt2_vocab() -> None:
    assert hashlib.sha256(ENCODER_JSON.read_bytes()).hexdigest() == ENCODER_SHA256
    assert hashlib.sha256(VOCAB_BPE.read_bytes()).hexdigest() == VOCAB_BPE_SHA256


def test_vocab_constants(tok: Tokenizer) -> None:
    assert (tok.n_vocab, tok.eot_token, tok.eot_text) == (50257, 50256, EOT)
    assert tok.decode([tok.eot_token]) == EOT
    assert Tokenizer.default() is tok  # cached: built once per process
    assert load_tokenizer() is tok
    assert tok.vocab_path is not None and tok.vocab_path.name == "encoder.json"


# --- encoding against references ----------------------------------------------------------------


def test_known_encodings(tok: Tokenizer) -> None:
    # ids published with GPT-2 (and in transformers' GPT2Tokenizer docstring)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" Hello world") == [18435, 995]
    fox = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]
    assert tok.encode("The quick brown fox jumps over the lazy dog.") == fox


@pytest.mark.parametrize("text", CORPUS)
def test_matches_openai_and_tiktoken(tok, openai_ref, tiktoken_ref, text: str) -> None:
    ids = tok.encode(text)
    assert ids == openai_ref.encode(text)
    assert ids == tiktoken_ref.encode_ordinary(text)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", CORPUS)
def test_matches_transformers(tok, hf_refs, text: str) -> None:
    for hf in hf_refs:
        assert tok.encode(text) == hf_encode_plain(hf, text), type(hf).__name__


def test_endoftext_is_plain_text_by_default(tok, openai_ref, tiktoken_ref, hf_refs) -> None:
    for text in EOT_CORPUS:
        ids = tok.encode(text)
        assert 50256 not in ids
        assert ids == openai_ref.encode(text) == tiktoken_ref.encode_ordinary(text)
        assert tok.decode(ids) == text
    # the marker alone splits as '<', '|', 'end', 'of', 'text', '|', '>'
    assert tok.encode(EOT) == [27, 91, 437, 1659, 5239, 91, 29]


def test_endoftext_allowed_special(tok, tiktoken_ref, hf_refs) -> None:
    assert tok.encode("Hello<|endoftext|>world", allow_special=True) == [
        *tok.encode("Hello"),
        50256,
        *tok.encode("world"),
    ]
    assert tok.encode(EOT, allow_special=True) == [50256]
    for text in EOT_CORPUS:
        ids = tok.encode(text, allow_special=True)
        assert ids == tiktoken_ref.encode(text, allowed_special="all")
        for hf in hf_refs:  # HF matches <|endoftext|> as a special token by default
            assert ids == hf(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text


def test_encode_batch(tok, tiktoken_ref) -> None:
    assert tok.encode_batch(CORPUS) == [tiktoken_ref.encode_ordinary(t) for t in CORPUS]
    assert tok.encode_batch(CORPUS, allow_special=True) == [
        tiktoken_ref.encode(t, allowed_special="all") for t in CORPUS
    ]
    assert tok.encode_batch([]) == []


# --- decoding -----------------------------------------------------------------------------------


def test_decode_half_a_character_gives_replacement(tok, tiktoken_ref) -> None:
    ids = tok.encode("😀")
    assert ids == tiktoken_ref.encode_ordinary("😀") and len(ids) == 2  # F0 9F 98 | 80
    assert tok.decode_bytes(ids[:1]) == "😀".encode()[:3]
    assert tok.decode(ids[:1]) == "\ufffd" == tiktoken_ref.decode(ids[:1])
    assert tok.decode(ids[1:]) == "\ufffd"
    assert tok.decode(ids) == "😀"


@pytest.mark.parametrize("bad", [50257, 60000, -1, 10**12])
def test_decode_bad_id_raises(tok, bad: int) -> None:
    with pytest.raises(ValueError, match=rf"token id {bad} .*50257"):
        tok.decode([15496, bad, 995])
    with pytest.raises(ValueError, match=rf"token id {bad}"):
        tok.decoder().feed(bad)


def test_decode_accepts_int_and_array_like(tok) -> None:
    np = pytest.importorskip("numpy")
    assert tok.decode(15496) == "Hello"
    assert tok.decode(np.array([15496, 995])) == "Hello world"
    assert tok.decode(x for x in [15496, 995]) == "Hello world"


def _byte_token(tiktoken_ref: tiktoken.Encoding, b: int) -> int:
    return tiktoken_ref.encode_single_token(bytes([b]))


def test_incremental_decoder_holds_back_partial_characters(tok) -> None:
    dec = tok.decoder()
    assert isinstance(dec, IncrementalDecoder)
    assert dec.feed(47249) == ""  # F0 9F 98: first three bytes of 😀
    assert dec.feed([222]) == "😀"
    assert dec.feed(tok.encode(" 中文")) == " 中文"
    assert dec.feed(47249) == ""
    assert dec.flush() == "\ufffd"  # the unfinished emoji, now final
    assert dec.feed(tok.encode("ok")) == "ok"  # flush reset the decoder
    assert dec.flush() == ""


def test_incremental_decoder_emits_impossible_bytes_at_once(tok, tiktoken_ref) -> None:
    dec = tok.decoder()
    assert dec.feed(_byte_token(tiktoken_ref, 0xFF)) == "\ufffd"  # 0xFF never starts UTF-8
    assert dec.feed(_byte_token(tiktoken_ref, 0xF0)) == ""  # could still become a 4-byte char...
    assert dec.feed(tok.encode("A")) == "\ufffdA"  # ...until 'A' rules that out
    assert dec.flush() == ""


# --- properties ----------------------------------------------------------------------------------

MULTIBYTE = st.text(alphabet=st.sampled_from(list("😀🎉👍🏽中文日本語한글é\u0301\u200d🇺🇸 a\n")), max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_roundtrip_any_text(text: str) -> None:
    tok = Tokenizer.default()
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, allow_special=True)) == text


def _feed_one_by_one(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = tok.decoder()
    return [dec.feed(i) for i in ids] + [dec.flush()]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(), MULTIBYTE))
def test_incremental_decoder_matches_decode(text: str) -> None:
    tok = Tokenizer.default()
    ids = tok.encode(text)
    pieces = _feed_one_by_one(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    if "\ufffd" not in text:
        # no piece may hold half a character: any split would have shown up as U+FFFD
        assert all("\ufffd" not in p for p in pieces)
    assert pieces[-1] == ""  # valid text leaves nothing held back


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=50256), max_size=30))
def test_incremental_decoder_matches_decode_on_arbitrary_ids(ids: list[int]) -> None:
    # arbitrary ids are often invalid UTF-8; streamed and whole decoding must still agree
    tok = Tokenizer.default()
    assert (
        "".join(_feed_one_by_one(tok, ids))
        == tok.decode(ids)
        == tok.decode_bytes(ids).decode("utf-8", "replace")
    )


# --- saving and loading directories --------------------------------------------------------------


def test_save_is_read_by_transformers(tok, tmp_path: Path) -> None:
    written = tok.save(tmp_path)
    names = {"vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"}
    assert {p.name for p in written} == names
    assert {p.name for p in tmp_path.iterdir()} == names  # no temp files left behind
    merges = (tmp_path / "merges.txt").read_text(encoding="utf-8").split("\n")
    assert merges[0] == "#version: 0.2"
    assert merges[1:] == VOCAB_BPE.read_text(encoding="utf-8").split("\n")[1:]
    assert json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8")) == json.loads(
        ENCODER_JSON.read_text(encoding="utf-8")
    )

    reloaded = Tokenizer.from_dir(tmp_path)
    assert reloaded.vocab_path == tmp_path / "vocab.json"
    for cls in _hf_classes():
        hf = cls.from_pretrained(str(tmp_path))
        assert hf.model_max_length == 1024
        assert hf.bos_token == hf.eos_token == hf.unk_token == EOT
        assert hf.eos_token_id == 50256
        for text in CORPUS:
            ids = tok.encode(text)
            assert ids == hf_encode_plain(hf, text) == reloaded.encode(text), text
            assert hf.decode(ids) == tok.decode(ids), text
        assert hf(EOT_CORPUS[0], add_special_tokens=False)["input_ids"] == tok.encode(
            EOT_CORPUS[0], allow_special=True
        )


def test_save_overwrites_existing_files(tok, tmp_path: Path) -> None:
    (tmp_path / "vocab.json").write_text("stale", encoding="utf-8")
    tok.save(tmp_path)
    assert Tokenizer.from_dir(tmp_path).encode("Hello world") == [15496, 995]


def _write_small_vocab(directory: Path, n_merges: int, vocab_name: str, merges_name: str) -> None:
    """GPT-2's first n_merges merges with ids renumbered densely: a different, consistent vocab."""
    directory.mkdir(parents=True, exist_ok=True)
    full = json.loads(ENCODER_JSON.read_text(encoding="utf-8"))
    lines = VOCAB_BPE.read_text(encoding="utf-8").split("\n")
    merges = lines[1 : 1 + n_merges]
    vocab = {t: i for t, i in full.items() if i < 256}  # GPT-2's ids 0..255 are the 256 bytes
    for line in merges:
        vocab["".join(line.split(" "))] = len(vocab)
    vocab[EOT] = len(vocab)
    (directory / vocab_name).write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (directory / merges_name).write_text("\n".join([lines[0], *merges, ""]), encoding="utf-8")


@pytest.mark.parametrize("names", [("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")])
def test_from_dir_uses_the_directorys_own_files(tok, tmp_path: Path, names: tuple[str, str]) -> None:
    _write_small_vocab(tmp_path, 300, *names)
    small = Tokenizer.from_dir(tmp_path)
    assert small.vocab_path == tmp_path / names[0]
    assert (small.n_vocab, small.eot_token) == (256 + 300 + 1, 556)
    ref = OpenAIEncoder(tmp_path / names[0], tmp_path / names[1])
    for text in PLAIN_CORPUS:
        assert small.encode(text) == ref.encode(text), text
        assert small.decode(small.encode(text)) == text
    assert small.encode("Hello world") != tok.encode("Hello world")


def test_from_dir_matches_transformers_on_other_vocab(tmp_path: Path) -> None:
    _write_small_vocab(tmp_path, 1000, "vocab.json", "merges.txt")
    small = Tokenizer.from_dir(tmp_path)
    for cls in _hf_classes():
        hf = cls.from_pretrained(str(tmp_path))
        for text in PLAIN_CORPUS:
            assert small.encode(text) == hf_encode_plain(hf, text), text


def test_from_dir_without_files_is_default(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    assert Tokenizer.from_dir(tmp_path) is Tokenizer.default()
    with pytest.raises(NotADirectoryError):
        Tokenizer.from_dir(tmp_path / "config.json")


def test_from_dir_prefers_hf_names(tmp_path: Path) -> None:
    shutil.copyfile(ENCODER_JSON, tmp_path / "encoder.json")
    shutil.copyfile(VOCAB_BPE, tmp_path / "vocab.bpe")
    (tmp_path / "vocab.json").write_text("{not json", encoding="utf-8")
    shutil.copyfile(VOCAB_BPE, tmp_path / "merges.txt")
    with pytest.raises(ValueError, match="vocab.json"):
        Tokenizer.from_dir(tmp_path)


def test_from_dir_half_a_pair_raises(tmp_path: Path) -> None:
    shutil.copyfile(ENCODER_JSON, tmp_path / "vocab.json")
    with pytest.raises(ValueError, match="merges.txt"):
        Tokenizer.from_dir(tmp_path)


def _corrupt_vocab(vocab: dict, merges: list[str]) -> None:
    vocab["Ġthe"], vocab["Ġa"] = vocab["Ġa"], vocab["Ġthe"]  # ids no longer in merge order


@pytest.mark.parametrize(
    ("broken", "edit", "message"),
    [
        ("vocab", lambda v, m: v.pop(EOT), "no '<\\|endoftext\\|>'"),
        ("vocab", lambda v, m: v.update({"Ġthe": 5}), "ids must be exactly"),
        ("vocab", lambda v, m: v.update({"héllo☃": 50257}), "not in GPT-2's byte-to-unicode"),
        ("vocab", lambda v, m: v.update({"x": True}), "expected an int"),
        ("vocab", _corrupt_vocab, "merge order"),
        ("merges", lambda v, m: m.insert(5, "a b c"), "line 7"),
        ("merges", lambda v, m: m.pop(), "do not belong together"),
        ("merges", lambda v, m: m.__setitem__(10, "zz qq"), "not in"),
    ],
)
def test_malformed_files_raise_naming_the_file(tmp_path: Path, broken: str, edit, message: str) -> None:
    vocab = json.loads(ENCODER_JSON.read_text(encoding="utf-8"))
    merges = VOCAB_BPE.read_text(encoding="utf-8").split("\n")[1:-1]
    edit(vocab, merges)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("\n".join(["#version: 0.2", *merges, ""]), encoding="utf-8")
    bad_file = tmp_path / ("vocab.json" if broken == "vocab" else "merges.txt")
    with pytest.raises(ValueError, match=message) as err:
        Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert str(bad_file) in str(err.value)


def test_not_json_raises_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "encoder.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(ValueError, match="encoder.json"):
        Tokenizer.from_files(tmp_path / "encoder.json", VOCAB_BPE)


# --- whitespace runs of any length ---------------------------------------------------------------

_WS_UNITS = [" ", "\n", "\t", " \n\t", "\r\n", "\n\n ", "\xa0", " \u3000", "\u2028\n"]
_WS_CONTEXTS = [("", ""), ("a", ""), ("", "b"), ("x", "y"), ("def f():", " return"), ("é", "\n1"), ("'s", "'s")]


@pytest.mark.parametrize("unit", _WS_UNITS, ids=repr)
@pytest.mark.parametrize("length", [LONG_WHITESPACE - 1, LONG_WHITESPACE, LONG_WHITESPACE + 1, 5001, 10_000])
def test_long_whitespace_runs_give_gpt2s_ids(tok, tiktoken_ref, openai_ref, unit: str, length: int) -> None:
    """Runs long enough to be tokenized apart from the regex give exactly the ids of the unsplit
    encoding (tiktoken handles these lengths) and of OpenAI's encoder.py, with text on either side."""
    run = (unit * (length // len(unit) + 1))[:length]
    for before, after in _WS_CONTEXTS:
        text = before + run + after
        want = tiktoken_ref.encode_ordinary(text)
        assert tok.encode(text) == want, (before, after)
        assert tok.encode_batch([text, "hi"]) == [want, [5303]]
        if length <= 5001:  # the pure-Python reference is slow on the longest runs
            assert openai_ref.encode(text) == want, (before, after)
    special = "a" + run + EOT + run + "b"
    assert tok.encode(special, allow_special=True) == tiktoken_ref.encode(special, allowed_special="all")
    assert tok.encode(special) == tiktoken_ref.encode_ordinary(special)


@pytest.mark.parametrize("unit, ids", [(" ", [220]), ("\n", [628]), (" \n\t", [220, 198, 197])], ids=repr)
def test_a_million_whitespace_characters(tok, unit: str, ids: list[int]) -> None:
    """About 1,000,000 whitespace characters overflowed tiktoken's regex stack (a Rust panic that no
    `except Exception` catches). GPT-2 has no token for two spaces and none longer than "\\n\\n", so the
    ids are known: the run up to its last character is one piece, repeating `ids`."""
    n = 1_000_002 if unit == "\n" else 999_999  # the piece is the run less its last character
    run = unit * (n // len(unit))
    piece = run[:-1]
    per = len("".join(tok.decode(i) for i in ids))
    body = ids * (len(piece) // per) + tok.encode(piece[len(piece) - len(piece) % per:])
    assert tok.encode("a" + run + "b") == [64, *body, *tok.encode(run[-1] + "b")]
    assert tok.encode(run) == ids * (len(run) // per) + tok.encode(run[len(run) - len(run) % per:])


def test_many_runs_just_below_the_cut_stay_fast_and_exact(tok, tiktoken_ref) -> None:
    """Runs a little shorter than LONG_WHITESPACE go to tiktoken whole; finding that out must not be
    quadratic in their length (an unanchored search took 37 s on this text)."""
    import time

    text = ("x" + " " * (LONG_WHITESPACE - 96)) * 200
    t0 = time.perf_counter()
    ids = tok.encode(text)
    took = time.perf_counter() - t0
    assert ids == tiktoken_ref.encode_ordinary(text)
    assert took < 10, f"{took:.1f} s"
