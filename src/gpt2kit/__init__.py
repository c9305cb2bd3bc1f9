"""gpt2kit: GPT-2, complete, exact and fast."""
