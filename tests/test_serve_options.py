"""ServeOptions: validated where it is defined, torch- and FastAPI-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpt2kit.serve.options import ServeOptions


@pytest.mark.parametrize("field,value,needle", [
    ("max_batch", 0, "max_batch must be an integer >= 1, got 0"),
    ("max_queue", -1, "max_queue must be an integer >= 0, got -1"),
    ("prefill_chunk", 0, "prefill_chunk must be an integer >= 1, got 0"),
    ("max_tokens_per_request", 0, "max_tokens_per_request must be an integer >= 1"),
    ("max_body_bytes", 0, "max_body_bytes must be an integer >= 1, got 0"),
    ("prefix_cache_tokens", -1, "prefix_cache_tokens must be an integer >= 0"),
    ("read_timeout", 0.0, "read_timeout must be a finite number of seconds >= 0.001"),
    ("admission_window", -0.1, "admission_window must be seconds in [0, 1], got -0.1"),
    ("admission_window", 2, "admission_window must be seconds in [0, 1], got 2"),
])
def test_bad_values_raise_naming_the_value_and_the_limit(field, value, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        ServeOptions(**{field: value})


def test_the_defaults_are_valid_and_hosts_become_a_tuple():
    assert ServeOptions(allowed_hosts=["a.example"]).allowed_hosts == ("a.example",)


def test_importing_the_options_imports_neither_torch_nor_fastapi():
    code = ("import sys; import gpt2kit.serve.options; import gpt2kit.sampling; "
            "print(sorted(m for m in ('torch', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
