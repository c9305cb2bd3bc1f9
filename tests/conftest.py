"""pytest's set-up for the whole suite; what tests share lives in helpers.py."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import warnings

import pytest
from helpers import random_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
# measured kernel choices go to a store of the session's own, never the user's (decode/kernel_choice.py)
if "GPT2KIT_KERNEL_STORE" not in os.environ:
    os.environ["GPT2KIT_KERNEL_STORE"] = tempfile.mkdtemp(prefix="gpt2kit-test-kernel-store-")
    atexit.register(shutil.rmtree, os.environ["GPT2KIT_KERNEL_STORE"], True)
warnings.filterwarnings("ignore", message=".*bos_token_id.*")
# A suite started as a background job of a non-interactive shell (`cmd &`, nohup ... &) inherits SIGINT
# ignored, and so would every process a test starts: Python then installs no KeyboardInterrupt handler,
# and the tests that send a subprocess Ctrl-C wait for it in vain. Handled here, default in children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def tiny_model():
    return random_model()
