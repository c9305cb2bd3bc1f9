"""pytest's set-up for the whole suite; what tests share lives in helpers.py."""

from __future__ import annotations

import atexit
import os
import shutil
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


@pytest.fixture
def tiny_model():
    return random_model()
