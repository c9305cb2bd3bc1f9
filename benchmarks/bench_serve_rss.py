"""Server memory under a long mixed load: `python benchmarks/bench_serve_rss.py [--preset gpt2-tiny]`.

What it checks: 1,000 requests leave RSS within 5% of where it settled. --requests requests
(default 1,000), --clients at a time, a fixed mix that touches every path a request can take —
completions whole and streamed, chat (n 1 and 2), echo scoring (lm-eval's `echo` +
`logprobs` + `max_tokens: 0`, contexts sharing prefixes, so the prefix cache fills and evicts), a
streamed request whose client goes away after its first tokens (its row cancelled), a request
refused with 400 — against a `gpt2kit serve` subprocess it starts (a random-weight model of the
preset's shape, or --model; the server runs on the `gpt2kit` this Python imports), or against
--url with --pid, the server's process id. The server's resident set (VmRSS of /proc/PID/status)
is read after --settle requests (default 100: first-use allocations, kernel choices and the caches
filled by then) and after the last, once the server has been idle --quiet seconds (default 2);
printed: both, their ratio and the peak seen, and with --every K a reading every K requests.
--kinds runs a part of the mix (to find which path grows). A memory check, not a speed check: the
machine's load does not change it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time

from gpt2kit.machine import describe_cpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import start_server

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
KINDS = ("completion", "completion-stream", "chat", "completion-stream", "echo-score", "echo-score", "disconnect",
         "bad")
WORDS = "the of and to in is was for on that with as by at from his it an were are which this be".split()


def rss_kib(pid: int) -> int:
    """VmRSS of process pid, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise SystemExit(f"bench_serve_rss: no VmRSS in /proc/{pid}/status")


def _request(i: int, rng: random.Random, kinds: tuple[str, ...] = KINDS) -> tuple[str, str, dict]:
    """Request i of the mix: (kind, path, body)."""
    kind = kinds[i % len(kinds)]
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
    sampled = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0}
    if kind.startswith("completion"):
        return kind, "/v1/completions", {"prompt": text, "max_tokens": rng.randint(1, 24), "logprobs": i % 3,
                                         "stream": kind.endswith("stream"), **sampled}
    if kind == "chat":  # (streamed chat is refused by gpt2kit serve)
        return kind, "/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                              "max_tokens": rng.randint(1, 24), "n": 1 + i % 2, **sampled}
    if kind == "echo-score":  # lm-eval's loglikelihood request: a context (one of few) and an ending
        context = " ".join(WORDS[(i // 64 + k) % len(WORDS)] for k in range(30))
        return kind, "/v1/completions", {"prompt": context + " " + text, "max_tokens": 0, "echo": True,
                                         "logprobs": 1, "temperature": 0}
    if kind == "disconnect":
        return kind, "/v1/completions", {"prompt": text, "max_tokens": 200, "stream": True,
                                         "logit_bias": {"50256": -100}, **sampled}
    return kind, "/v1/completions", {"prompt": text, "max_tokens": -1}  # 400


async def _send(client, url: str, kind: str, path: str, body: dict) -> str | None:
    """One request; None when it ended as its kind should (a disconnect: two chunks read, then
    gone), else what went wrong."""
    body = {"model": "bench", **body}
    if not body.get("stream"):
        r = await client.post(url + path, json=body)
        return None if r.status_code == (400 if kind == "bad" else 200) else f"{kind}: {r.status_code} {r.text[:200]}"
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return f"{kind}: {r.status_code} {(await r.aread())[:200]!r}"
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if kind == "disconnect" and chunks == 2:
                    return None  # leaving the block closes the connection mid-stream
            elif line == "data: [DONE]":
                return None if kind != "disconnect" else f"{kind}: ended before its second chunk"
    return f"{kind}: the stream ended without [DONE]"


async def _load(url: str, first: int, n: int, clients: int, seed: int, pid: int, peak: list[int],
                kinds: tuple[str, ...] = KINDS) -> list[str]:
    """Requests first .. first + n - 1, clients at a time; what went wrong with those that failed."""
    import httpx

    rng = random.Random(seed)
    reqs = [_request(i, rng, kinds) for i in range(first + n)][first:]
    sem = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        async def run(req: tuple[str, str, dict]) -> str | None:
            async with sem:
                wrong = await _send(client, url, *req)
                peak[0] = max(peak[0], rss_kib(pid))
                return wrong

        results = await asyncio.gather(*(run(r) for r in reqs))
    return [r for r in results if r is not None]


def _idle(url: str, quiet: float, limit: float = 120.0) -> None:
    """Wait until the server runs and queues no row (a cancelled row has left its slot), then `quiet`
    seconds more (gpt2kit serve gives free heap memory back after half a second without work)."""
    import httpx

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=30).text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith(("gpt2kit_batch_size ", "gpt2kit_queue_length "))}
        if not any(values.values()):
            time.sleep(quiet)
            return
        time.sleep(0.1)
    raise SystemExit(f"bench_serve_rss: the server still had rows after {limit:g} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-tiny", help="model shape (random weights), default gpt2-tiny")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of a random preset")
    p.add_argument("--url", default=None, help="a running gpt2kit server (with --pid) instead of starting one; "
                                               "it must serve the model as 'bench' with a chat template")
    p.add_argument("--pid", type=int, default=None, help="the process id of the server at --url")
    p.add_argument("--requests", type=int, default=1000, help="requests in all (default 1000)")
    p.add_argument("--settle", type=int, default=100, help="requests before RSS is taken as settled (default 100)")
    p.add_argument("--clients", type=int, default=8, help="requests in flight, and the server's --max-batch (8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", type=float, default=2.0, help="seconds the server is left idle before each RSS "
                                                             "reading (default 2)")
    p.add_argument("--every", type=int, default=0, help="also read RSS (idle) after every this many requests "
                                                         "past --settle, printed as a trace (default: only the end)")
    p.add_argument("--kinds", default=None, help="a comma-separated part of the mix (default all: "
                                                 f"{','.join(sorted(set(KINDS)))}), to find which grows")
    args = p.parse_args(argv)
    if (args.url is None) != (args.pid is None):
        p.error("--url and --pid go together")
    kinds = KINDS if args.kinds is None else tuple(args.kinds.split(","))
    if not set(kinds) <= set(KINDS):
        p.error(f"--kinds: unknown {sorted(set(kinds) - set(KINDS))}; the mix has {sorted(set(KINDS))}")
    if not 0 < args.settle < args.requests:
        p.error(f"--settle must be in [1, --requests={args.requests}), got {args.settle}")

    with tempfile.TemporaryDirectory() as tmp:
        proc = None
        url, pid = args.url, args.pid
        if url is None:
            model_dir = args.model
            if model_dir is None:
                from gpt2kit.checkpoint import save_model
                from gpt2kit.model import GPT2

                model_dir = os.path.join(tmp, args.preset)
                save_model(GPT2.from_name(args.preset), model_dir)
            template = os.path.join(tmp, "chat.jinja")
            with open(template, "w") as f:
                f.write(TEMPLATE)
            proc, url = start_server(model_dir, ["--max-batch", str(args.clients), "--max-queue",
                                                 str(4 * args.clients), "--chat-template", template],
                                     who="bench_serve_rss")
            pid = proc.pid
        try:
            peak = [rss_kib(pid)]
            start = peak[0]
            failed = asyncio.run(_load(url, 0, args.settle, args.clients, args.seed, pid, peak, kinds))
            _idle(url, args.quiet)
            settled = rss_kib(pid)
            trace = [(args.settle, settled)]
            every = args.every or args.requests
            for first in range(args.settle, args.requests, every):
                n = min(every, args.requests - first)
                failed += asyncio.run(_load(url, first, n, args.clients, args.seed, pid, peak, kinds))
                _idle(url, args.quiet)
                trace.append((first + n, rss_kib(pid)))
            end = trace[-1][1]
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)

    mib = lambda k: f"{k / 1024:.1f} MiB"  # noqa: E731
    print(f"# bench_serve_rss: {args.model or args.url or args.preset + ' (random weights)'}, {args.requests} "
          f"requests ({', '.join(sorted(set(kinds)))}), {args.clients} clients, settled after {args.settle}")
    print(f"# CPU: {describe_cpu()}; load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    print("| ready | settled | end | peak | end / settled | failed |")
    print("|---|---|---|---|---|---|")
    print(f"| {mib(start)} | {mib(settled)} | {mib(end)} | {mib(peak[0])} | {end / settled:.3f} | {len(failed)} |")
    if len(trace) > 2:
        print("RSS after requests: " + ", ".join(f"{n}: {k / 1024:.0f}" for n, k in trace) + " MiB")
    for wrong in failed[:5]:
        print(f"failed: {wrong}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
