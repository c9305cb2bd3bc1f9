"""The distributions: `python -m build` makes an sdist and a wheel from a copy of the source tree; the
wheel, installed on its own (not editable, run outside the checkout), carries every file the package
needs: generate, quantize --int8 and generate on the int8 copy (the native kernel built from the C
sources in the wheel), trace and serve all run from it, and answer what the checkout answers.

The installed copy reuses this environment's dependencies (torch, ...): `pip install --no-deps
--target` puts the package alone in a folder that PYTHONPATH puts ahead of the editable install.
"""

from __future__ import annotations

import email.parser
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import random_model

import gpt2kit
from gpt2kit.checkpoint import save_model
from gpt2kit.config import GPT2Config

ROOT = Path(__file__).resolve().parents[1]
CFG = GPT2Config(n_vocab=50257, n_ctx=64, n_embd=64, n_head=2, n_layer=2)
REPO_ONLY = (".ci/", ".gitignore")  # CI's script and git's own file are not part of the sdist
TIMEOUT = 300  # seconds for one command: a bound against a hang, far above what one takes
NO_EOT = {"50256": -100}  # every completion runs its max_tokens


def _source_files() -> list[str]:
    """The checkout's files as git sees them (tracked, and untracked ones it does not ignore)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"the distributions are built from a git checkout's files, and {ROOT} is not one ({e})")
    return sorted(f for f in out.decode().split("\0") if f and (ROOT / f).is_file())


@dataclass
class Built:
    files: list[str]  # the source tree's files, relative to its root
    wheel: Path
    sdist: Path
    site: Path  # the wheel installed here
    work: Path  # where the commands run: outside the checkout; holds the model

    @property
    def cache(self) -> Path:
        """The kernel cache of the commands below, empty at first: a kernel in it was built by one of them."""
        return self.work / "cache"


def _build(tmp: Path, files: list[str]) -> tuple[Path, Path]:
    if importlib.util.find_spec("build") is None:
        pytest.skip("the `build` package is not installed (the test extra has it: pip install -e '.[test]')")
    import build

    source = tmp / "source"
    for f in files:
        (source / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, source / f)
    # --no-isolation: the build backend from this environment (the test extra has it), nothing downloaded
    unmet = sorted(r for r in build.ProjectBuilder(source).build_system_requires if any(build.check_dependency(r)))
    if unmet:
        pytest.skip(f"python -m build --no-isolation needs {', '.join(unmet)} here (pip install -e '.[test]')")
    dist = tmp / "dist"
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
                          cwd=tmp, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
    return wheel, sdist


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    tmp = tmp_path_factory.mktemp("wheel")
    files = _source_files()
    wheel, sdist = _build(tmp, files)
    site = tmp / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
                           "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    work = tmp / "work"
    work.mkdir()
    save_model(random_model(CFG, seed=5), work / "model")
    return Built(files, wheel, sdist, site, work)


def _env(package: Path, cache: Path, **extra: str) -> dict[str, str]:
    """The environment of a command run from `package` (a folder holding gpt2kit/), with its own
    kernel cache and kernel-choice store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPT2KIT_")}
    return {**env, **extra, "PYTHONPATH": str(package), "GPT2KIT_CACHE": str(cache),
            "GPT2KIT_KERNEL_STORE": str(cache / "store"), "HF_HUB_OFFLINE": "1"}


def _wheel_cli(b: Built, argv: list[str], cache: Path, **extra: str) -> subprocess.CompletedProcess:
    """`gpt2kit *argv` through the console script the wheel installed."""
    done = subprocess.run([str(b.site / "bin" / "gpt2kit"), *argv], cwd=b.work, env=_env(b.site, cache, **extra),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    return done


def _checkout_cli(b: Built, argv: list[str], cache: Path, **extra: str) -> str:
    """The stdout of `python -m gpt2kit *argv` run from the checkout's src/: the reference."""
    done = subprocess.run([sys.executable, "-m", "gpt2kit", *argv], cwd=b.work, env=_env(ROOT / "src", cache, **extra),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    return done.stdout


# --- what the distributions hold --------------------------------------------------------------

def test_the_wheel_holds_every_file_of_the_package_and_the_metadata_pypi_shows(built):
    with zipfile.ZipFile(built.wheel) as z:
        names = set(z.namelist())
        info = f"gpt2kit-{gpt2kit.__version__}.dist-info"
        meta = email.parser.Parser().parsestr(z.read(f"{info}/METADATA").decode())
        license_text = z.read(f"{info}/licenses/LICENSE")
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    package = {f.removeprefix("src/") for f in built.files if f.startswith("src/gpt2kit/")}
    for data in ("vocab/encoder.json", "vocab/vocab.bpe", "trace/assets/report.js", "decode/csrc/int8_linear.c",
                 "decode/csrc/solo.h", "serve/assets/playground.html"):
        assert f"gpt2kit/{data}" in package  # the comparison below covers the data files
    assert {n for n in names if not n.startswith(info)} == package
    assert license_text == (ROOT / "LICENSE").read_bytes() and b"MIT License" in license_text
    assert meta["Name"] == "gpt2kit" and meta["Version"] == gpt2kit.__version__
    assert meta["License-Expression"] == "MIT" and meta.get_all("License-File") == ["LICENSE"]
    assert meta["Requires-Python"] == ">=3.10" and meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().startswith("# gpt2kit")  # the README is the description
    classifiers = meta.get_all("Classifier")
    assert "Programming Language :: Python :: 3" in classifiers and not any(c.startswith("License ::") for c in
                                                                            classifiers)
    assert "gpt-2" in meta["Keywords"].split(",")
    torch_req = next(r for r in meta.get_all("Requires-Dist") if r.startswith("torch"))
    assert torch_req.startswith("torch>=") and "==" not in torch_req  # a range: the user's torch build stays
    assert "gpt2kit = gpt2kit.cli:main" in entry_points


def test_the_sdist_holds_the_source_its_tests_and_the_license(built):
    prefix = f"gpt2kit-{gpt2kit.__version__}/"
    with tarfile.open(built.sdist) as t:
        names = {m.name.removeprefix(prefix) for m in t.getmembers() if m.isfile()}
    wanted = {f for f in built.files if not f.startswith(REPO_ONLY)}
    assert {"LICENSE", "README.md", "pyproject.toml", "PKG-INFO", "tests/test_wheel.py"} <= names
    assert not wanted - names, f"missing from the sdist: {sorted(wanted - names)}"


# --- the installed wheel at work --------------------------------------------------------------

def test_the_installed_wheel_imports_from_its_own_folder(built, tmp_path):
    code = ("import importlib.metadata as m, importlib.resources as r, gpt2kit; "
            "print(gpt2kit.__file__); print(r.files('gpt2kit.decode').joinpath('csrc', 'step.c')); "
            "print(m.distribution('gpt2kit').locate_file('gpt2kit'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=built.work, env=_env(built.site, tmp_path),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        assert Path(line).is_relative_to(built.site), done.stdout
    version = _wheel_cli(built, ["--version"], tmp_path).stdout
    assert version.strip() == f"gpt2kit {gpt2kit.__version__}"


def _kernels(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "kernels").glob("*.so"))


def test_the_installed_wheel_generates_what_the_checkout_generates(built):
    argv = ["generate", "Hello world", "-m", "model", "-n", "8", "--seed", "0"]
    got = _wheel_cli(built, argv, built.cache).stdout
    built_here = _kernels(built.cache)
    assert got.strip() and got == _checkout_cli(built, argv, built.cache)
    # a kernel's name hashes its sources: the checkout takes the wheel's kernels for its own
    assert _kernels(built.cache) == built_here


def test_the_installed_wheel_quantizes_and_builds_its_kernel_from_the_c_sources_it_holds(built, tmp_path):
    from gpt2kit.decode import native

    if native.int8_linear() is None:
        pytest.skip(f"the native kernels cannot run here: {native.why_unavailable()}")
    cache = built.cache
    _wheel_cli(built, ["quantize", "model", str(tmp_path / "int8"), "--int8"], cache)
    before = _kernels(cache)
    # the int8 products forced onto the C kernel, so it is built and runs wherever it can
    argv = ["generate", "Hello world", "-m", str(tmp_path / "int8"), "-n", "8", "--seed", "0"]
    got = _wheel_cli(built, argv, cache, GPT2KIT_INT8_KERNEL="native-avx2").stdout
    built_here = _kernels(cache)
    new = [name for name in built_here if name not in before]
    assert any(name.startswith("int8_linear-") for name in new), (before, built_here)
    assert got.strip() and got == _checkout_cli(built, argv, cache, GPT2KIT_INT8_KERNEL="native-avx2")
    assert _kernels(cache) == built_here  # the checkout's sources hash to the wheel's: it built none


def test_the_installed_wheel_writes_a_trace_report_with_its_assets(built, tmp_path):
    out = tmp_path / "report.html"
    _wheel_cli(built, ["trace", "Hello world", "-m", "model", "--out", str(out)], built.cache)
    page = out.read_text(encoding="utf-8")
    for asset in ("report.css", "report.js", "sampling.js"):
        assert (ROOT / "src/gpt2kit/trace/assets" / asset).read_text(encoding="utf-8") in page


def _ready_url(proc: subprocess.Popen, lines: list[str]) -> str:
    """The URL of the server's ready line, waited for (bounded); fails with its stderr if it exits."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        ready = next((line for line in list(lines) if "ready: serving" in line), None)
        if ready:
            return ready.split(" on ", 1)[1].split()[0]
        time.sleep(0.1)
    pytest.fail("the server did not get ready:\n" + "".join(lines))


def test_the_installed_wheel_serves_a_completion(built):
    import httpx

    argv = [str(built.site / "bin" / "gpt2kit"), "serve", "-m", "model", "--port", "0"]  # port 0: a free one
    proc = subprocess.Popen(argv, cwd=built.work, env=_env(built.site, built.cache), stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        url = _ready_url(proc, lines)
        body = {"model": "model", "prompt": "Hello world", "max_tokens": 4, "logit_bias": NO_EOT}
        r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["text"]
        page = httpx.get(url + "/", timeout=TIMEOUT)  # the playground, from the wheel's own asset
        assert page.status_code == 200
        assert page.text == (ROOT / "src/gpt2kit/serve/assets/playground.html").read_text(encoding="utf-8")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(60)
        reader.join(10)
