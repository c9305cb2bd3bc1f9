"""The docs run as written: every ```bash / ```sh / ```console / ```python block of README.md,
CONTRIBUTING.md and docs/ runs, in order, in one working directory per page, where small random models
stand in for the hub names the blocks use (gpt2 ... gpt2-xl, with the real sizes' layer and head counts,
so names like h.9.attn.head.9 exist) and small files stand in for the inputs they name. A block that cannot
run here (network, GPU, real weights, a server, minutes of CPU) has `<!-- skip: REASON -->` on the line
before it and is skipped with that reason. Python blocks of a page share one namespace (a page reads as
one session); shell blocks run under bash -e with `gpt2kit` as this interpreter's `python -m gpt2kit`.
docs/check.md's blocks run in tests/test_check.py, which also compares their printed output.

Also: every relative link (and #anchor) in these pages resolves, the README links every page in docs/,
and docs/reference/cli.md is what gpt2kit.cli.reference writes from the CLI's parser today."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN_ELSEWHERE = {ROOT / "docs" / "check.md": "runs in tests/test_check.py, output compared",
                 ROOT / "docs" / "explore.md": "runs in tests/test_explore.py, its server on a free port"}
LANGS = {"bash", "sh", "console", "python"}
BLOCK_SECONDS = 600  # a guard against a block that never ends (a server): it needs its skip marker
# hub name -> (n_layer, n_head, n_embd): the real sizes' depth and heads, a few dims per head
STAND_INS = {"gpt2": (12, 12, 48), "gpt2-medium": (24, 16, 64), "gpt2-large": (36, 20, 40), "gpt2-xl": (48, 25, 50),
             "runs/stdlib": (4, 4, 32)}  # the main job's model (gpt2-tiny's depth), which the docs go on to use
INPUTS = {
    "text.txt": "The quick brown fox jumps over the lazy dog.\n",
    "val.txt": "It was the best of times, it was the worst of times.\n" * 40,
    "story.txt": "Once upon a time there was a small dog who lived by the sea.\n",
    "long.txt": "A long text, read a line at a time.\n" * 20,
    "some_file.py": "def add(a, b):\n    return a + b\n",
    "prompts.jsonl": '{"prompt": "Hello"}\n{"prompt": "Once upon a time"}\n',
    "ioi.jsonl": '{"clean": "When Mary and John went to the store, John gave a drink to", '
                 '"corrupt": "When Mary and John went to the store, Mary gave a drink to", '
                 '"answer": " Mary", "wrong": " John"}\n',
    "edit_request.txt": "def area(w, h):\n    return w * h\n\n# the same, renamed:\ndef area(width, height):\n",
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the opening fence's line, 1-based
    lang: str
    code: str
    skip: str | None  # the reason in <!-- skip: REASON --> on the line before, if any

    @property
    def id(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"


def blocks_of(page: Path, text: str | None = None) -> list[Block]:
    lines = (page.read_text(encoding="utf-8") if text is None else text).split("\n")
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(`{3,})(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(2))), len(lines))
        if fence.group(3) in LANGS:
            indent = len(fence.group(1))
            code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
            before = lines[i - 1].strip() if i else ""  # indented blocks (in a list) too
            skip = m.group(1).strip() if (m := re.fullmatch(r"<!--\s*skip:(.*?)-->", before)) else None
            out.append(Block(page, i + 1, fence.group(3), code, skip))
        i = end + 1
    return out


ALL = [b for page in PAGES if page not in RUN_ELSEWHERE for b in blocks_of(page)]


# --- the working directory a page runs in -----------------------------------------------------------

@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> Path:
    """The stand-in models, saved once: GPT-2's vocabulary (the real tokenizer), the hub sizes' depth."""
    import torch

    from gpt2kit import GPT2Config, save_model
    from gpt2kit.model import GPT2

    d = tmp_path_factory.mktemp("zoo")
    for i, (name, (n_layer, n_head, n_embd)) in enumerate(STAND_INS.items()):
        torch.manual_seed(i)
        cfg = GPT2Config(n_vocab=50257, n_ctx=1024, n_embd=n_embd, n_head=n_head, n_layer=n_layer)
        save_model(GPT2(cfg).eval(), d / name)
    return d


@pytest.fixture(scope="session")
def workdirs(tmp_path_factory, zoo):
    """One directory per page, made on first use and kept for the page's later blocks."""
    made: dict[Path, Path] = {}

    def get(page: Path) -> Path:
        if page not in made:
            d = tmp_path_factory.mktemp(page.stem)
            for name in STAND_INS:
                hub = [d / "openai-community" / name] if name.startswith("gpt2") else []
                for alias in (d / name, *hub):
                    alias.parent.mkdir(parents=True, exist_ok=True)
                    alias.symlink_to(zoo / name, target_is_directory=True)
            for name, text in INPUTS.items():
                (d / name).write_text(text, encoding="utf-8")
            made[page] = d
        return made[page]

    return get


def shell_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "GPT2KIT_DOCS_ROOT": str(ROOT)}


def shell_script(block: Block) -> str:
    code = block.code
    if block.lang == "console":  # the commands are the `$ ` lines; the rest is their output
        code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ ")) + "\n"
    # gpt2kit is this interpreter's, on this tree's source; pip never runs here (a block that installs
    # is marked skip), so a forgotten marker fails instead of changing the environment
    return (f'gpt2kit() {{ "{sys.executable}" -m gpt2kit "$@"; }}\n'
            'pip() { echo "the docs test runs no pip: mark the block <!-- skip: installs -->" >&2; return 1; }\n'
            f'set -o pipefail\n{code}')


def run_shell(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-e", "-c", shell_script(block)], cwd=cwd, env=shell_env(), text=True,
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=BLOCK_SECONDS)


def run_python(block: Block, cwd: Path, namespace: dict) -> None:
    old = os.getcwd()
    os.chdir(cwd)
    try:
        exec(compile(block.code, block.id, "exec"), namespace)
    finally:
        os.chdir(old)


@pytest.fixture(scope="module")
def namespaces():
    return {}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only contend
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_block_runs(block, workdirs, namespaces, monkeypatch):
    if block.skip is not None:
        pytest.skip(block.skip)
    cwd = workdirs(block.page)
    if block.lang == "python":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        run_python(block, cwd, namespaces.setdefault(block.page, {"__name__": "__docs__"}))
        return
    proc = run_shell(block, cwd)
    assert proc.returncode == 0, f"{block.id} failed ({proc.returncode}):\n{block.code}\n{proc.stderr[-3000:]}"


def test_a_stale_block_fails(tmp_path, workdirs):
    """The runner is not lenient: a block with a flag the CLI no longer has, or Python naming a moved
    function, fails; and the skip marker is read only from the line just before the block."""
    page = tmp_path / "stale.md"
    text = ("```bash\ngpt2kit generate --model gpt2 hi --no-such-flag\n```\n\n"
            "```python\nfrom gpt2kit.generate import generate\n```\n\n"
            "<!-- skip: starts a server -->\n\n```bash\ntrue\n```\n")
    stale_shell, stale_python, spaced = blocks_of(page, text)
    assert run_shell(stale_shell, workdirs(ROOT / "README.md")).returncode != 0
    with pytest.raises(ImportError):
        run_python(stale_python, tmp_path, {})
    assert spaced.skip is None
    assert [b.skip for b in blocks_of(page, "<!-- skip: needs a GPU -->\n```sh\nx\n```\n")] == ["needs a GPU"]


# --- links ------------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces as -."""
    text = re.sub(r"`|\*\*|(?<!\w)_|_(?!\w)", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").split("\n"):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6}\s+(.*)", line)):
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # not inside code blocks
    text = re.sub(r"`[^`\n]*`", "", text)
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_readme_links_every_page_in_docs():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md's map of the docs lacks {missing}"


def test_cli_reference_is_generated():
    from gpt2kit.cli.reference import render

    committed = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    assert committed == render(), "stale: python -m gpt2kit.cli.reference docs/reference/cli.md"


# --- the README's server example, against a real server -----------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_serve_example_answers(workdirs, tmp_path):
    """The README's serve block (skipped above: it starts a server) run as a reader would: the server in
    one process, then its curl command and its OpenAI-client block against it, on a free port."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    import shutil
    import time
    import urllib.request

    if shutil.which("curl") is None:
        pytest.skip("no curl")
    readme = blocks_of(ROOT / "README.md")
    shell = next(b for b in readme if b.lang == "bash" and "gpt2kit serve" in b.code)
    client = next(b for b in readme if b.lang == "python" and "OpenAI(" in b.code)
    serve, _, curl = shell.code.partition("\n")
    port = _free_port()
    at = lambda code: code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")  # noqa: E731
    argv = serve.split("#")[0].split()
    assert argv[:2] == ["gpt2kit", "serve"], serve
    cwd = workdirs(ROOT / "README.md")
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "gpt2kit", *argv[1:], "--port", str(port)], cwd=cwd,
                              env=shell_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):  # the model loads in the background; /health answers 200 once it is ready
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        proc = subprocess.run(["bash", "-e", "-c", at(curl)], cwd=cwd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and '"choices"' in proc.stdout, (proc.stdout, proc.stderr)
        py = subprocess.run([sys.executable, "-c", at(client.code)], cwd=cwd, env=shell_env(), capture_output=True,
                            text=True, timeout=300)
        assert py.returncode == 0 and py.stdout.strip(), py.stderr
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
