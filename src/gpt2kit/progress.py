"""What a command shows while it works, on stderr: a status line on a terminal, a log line elsewhere.

On a terminal, `Status.show("loading runs/stdlib")` draws `gpt2kit generate: loading runs/stdlib
(0:00:07)` and redraws it twice a second, so a load or a long forward pass is visibly alive; the
next `show` replaces it, `hide` (before the command's own output reaches the same terminal) and
`close` wipe it. `Status.bar` gives a tqdm bar on the same terms. Piped or redirected stderr gets
one plain line per stage instead (`gpt2kit generate: loading runs/stdlib`), written when the stage
begins, so a log says what a command was doing and nothing on stdout changes; bars are terminal
only. `Status.message` writes a line of its own (a warning) without tearing the status line.
Torch-free.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from typing import IO

_CLEAR = "\r\x1b[K"  # back to the line's start, erase to its end


def is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Status:
    """One transient line on `stream` (default: stderr) naming what `prog` is doing; see the module doc."""

    def __init__(self, prog: str, stream: IO[str] | None = None, *, interval: float = 0.5):
        self.prog = prog
        self.stream = sys.stderr if stream is None else stream
        self.enabled = is_terminal(self.stream)
        self.interval = interval
        self._text: str | None = None  # what is shown now (None: nothing)
        self._last: str | None = None  # the stage _since belongs to
        self._since = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def show(self, text: str) -> None:
        """Replace the line with `text` and the time since that stage began; off a terminal, one line
        `PROG: TEXT` when the stage is not the one last written."""
        if not self.enabled:
            if text != self._last:
                self._last = text
                self._write(f"{self.prog}: {text}\n")
            return
        with self._lock:
            if text != self._last:  # the same stage shown again after a hide keeps its clock
                self._last, self._since = text, time.monotonic()
            self._text = text
        self._draw()
        if self._thread is None:
            self._thread = threading.Thread(target=self._redraw, name="gpt2kit-status", daemon=True)
            self._thread.start()

    def hide(self) -> None:
        """Wipe the line (the command's output comes next); `show` brings it back."""
        with self._lock:
            shown, self._text = self._text, None
            if shown is not None:
                self._write(_CLEAR)

    def message(self, line: str) -> None:
        """`line` on a line of its own, the status line (if shown) wiped first and drawn again after it."""
        with self._lock:
            self._write((_CLEAR if self._text is not None else "") + line + "\n")
        self._draw()

    def bar(self, total: int, *, unit: str, desc: str):
        """A tqdm bar on the stream (the status line hidden first), or None off a terminal."""
        if not self.enabled:
            return None
        from tqdm import tqdm

        self.hide()
        return tqdm(total=total, unit=unit, desc=desc, leave=False, dynamic_ncols=True, file=self.stream)

    def close(self) -> None:
        self.hide()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Status:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _redraw(self) -> None:
        while not self._stop.wait(self.interval):
            self._draw()

    def _draw(self) -> None:
        with self._lock:
            if self._text is None:
                return
            line = f"{self.prog}: {self._text} ({clock(time.monotonic() - self._since)})"
            width = max(20, shutil.get_terminal_size().columns - 1)  # a wrapped line cannot be redrawn
            self._write("\r" + line[:width] + "\x1b[K")

    def _write(self, s: str) -> None:
        try:
            self.stream.write(s)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: nothing to show it on
            self.enabled = False


def clock(seconds: float) -> str:
    """H:MM:SS."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
