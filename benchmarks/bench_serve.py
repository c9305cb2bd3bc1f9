"""Serving load benchmark: `python benchmarks/bench_serve.py [--preset gpt2] [--clients 8] ...`.

As vLLM's benchmark_serving does it: requests arrive as a Poisson process (--rate per second), at
most --clients in flight, each streaming --max-tokens tokens (<|endoftext|> banned by logit_bias, or
with --ignore-eos generated past, so every request has the same length); reported: request
throughput, output-token throughput, TTFT (arrival to first token, waiting for a free client
included), sent-TTFT (from the request being sent: the server's queue, prefill and first sample
only), TPOT (per output token after the first) and ITL (gaps between tokens), mean / median / p99.
The same load runs against two servers, interleaved: continuous batching (--max-batch = clients)
and one request at a time (--max-batch 1); the ratio
of their token throughputs is printed last. Each server is a `gpt2kit serve` subprocess on
127.0.0.1 with a random-weight model of the preset's shape (the speed does not depend on values).

--url adds an already-running OpenAI-compatible server (vLLM's, say) as a third row, named by
--url-name, sent --url-model as the model: the same requests, interleaved round by round with
gpt2kit's; --only-url leaves out the one-at-a-time server. A streamed chunk counts as many output
tokens as its choice's `logprobs.tokens` lists, or one when it has none but non-empty `text`; a
chunk with neither (a finish_reason-only or usage-only chunk) counts none (`chunk_tokens`), so
gpt2kit's chunks and vLLM's are counted alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from gpt2kit.machine import describe_cpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, args: list[str] | tuple[str, ...] = (), *, env: dict | None = None,
                 cwd=None, who: str = "bench_serve") -> tuple[subprocess.Popen, str]:
    """`gpt2kit serve --model model_dir` on a free loopback port, served as 'bench', with `args` after
    (env: the process's environment, None: this one's); (process, base URL) once /health answers 200.
    The benchmarks that start servers (bench_serve_rss, bench_lm_eval) use this one."""
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpt2kit", "serve", "--model", model_dir, "--port", str(port),
                             "--served-model-name", "bench", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{who}: the server exited with code {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{who}: the server did not become ready in 300 s")


def _start(model_dir: str, max_batch: int, clients: int, threads: int | None, extra: tuple[str, ...] = ()
           ) -> tuple[subprocess.Popen, str]:
    return start_server(model_dir, ["--max-batch", str(max_batch), "--max-queue", str(4 * clients), *extra],
                        env={**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None)


def chunk_tokens(chunk: dict) -> int:
    """How many output tokens one streamed /v1/completions chunk carries: the length of its first
    choice's `logprobs.tokens` when that is non-empty (a token whose bytes are not yet whole text
    has `text` "" but is listed there), else 1 for a non-empty `text`, else 0 (finish_reason- or
    usage-only chunks, `choices` empty)."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    tokens = (choices[0].get("logprobs") or {}).get("tokens") or []
    return len(tokens) if tokens else int(bool(choices[0].get("text")))


# How every request runs to max_tokens: <|endoftext|> banned by logit_bias, or (--ignore-eos) vLLM's
# ignore_eos extension, which both servers take: generation goes on past <|endoftext|>.
BAN_EOT = {"logit_bias": {"50256": -100}}
IGNORE_EOS = {"ignore_eos": True}


async def _one(client, url: str, prompt: str, max_tokens: int, arrived: float, model: str = "bench",
               to_the_end: dict | None = None) -> dict:
    sent = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logprobs": 0, **(BAN_EOT if to_the_end is None else to_the_end)}
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.extend([time.perf_counter()] * chunk_tokens(json.loads(line[6:])))
    ok = len(times) == max_tokens
    return {"ok": ok, "ttft": times[0] - arrived if times else None, "sent_ttft": times[0] - sent if times else None,
            "times": times, "arrived": arrived,
            "tokens": len(times)}


async def _load(url: str, n: int, clients: int, rate: float, max_tokens: int, seed: int, model: str = "bench",
                to_the_end: dict | None = None) -> dict:
    import httpx

    rng = random.Random(seed)
    words = "the of and to in is was for on that with as by at from his it an were are which this be".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 32))) for _ in range(n)]
    gaps = [rng.expovariate(rate) for _ in range(n)]
    sem = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        async def run(i: int, at: float) -> dict:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            arrived = time.perf_counter()
            async with sem:
                return await _one(client, url, prompts[i], max_tokens, arrived, model, to_the_end)

        start = time.perf_counter()
        at, tasks = start, []
        for i in range(n):
            at += gaps[i]
            tasks.append(asyncio.create_task(run(i, at)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    good = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in good]
    sent_ttft = [r["sent_ttft"] for r in good]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in good if r["tokens"] > 1]
    itl = [b - a for r in good for a, b in zip(r["times"], r["times"][1:], strict=False)]
    return {"requests": n, "failed": n - len(good), "wall_s": wall, "req_per_s": len(good) / wall,
            "tok_per_s": sum(r["tokens"] for r in good) / wall, "ttft": _stats(ttft),
            "sent_ttft": _stats(sent_ttft), "tpot": _stats(tpot),
            "itl": _stats(itl)}


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    xs = sorted(xs)
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs),
            "p99": xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2", help="model shape (random weights), default gpt2 (124M)")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of a random preset")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--requests", type=int, default=32, help="requests per run (default 32)")
    p.add_argument("--rate", type=float, default=16.0, help="Poisson arrival rate, requests/s (default 16)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the servers (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads in the servers (OMP_NUM_THREADS)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--serve-args", default="", help="extra `gpt2kit serve` flags for both servers, one string "
                                                    "(e.g. \"--prefill-idle-budget 128\")")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM's extension) instead of banning "
                   "<|endoftext|> with logit_bias")
    p.add_argument("--url", default=None, help="also measure this running OpenAI-compatible server "
                                               "(e.g. http://127.0.0.1:8011, vLLM's), interleaved with gpt2kit's")
    p.add_argument("--url-name", default="external", help="its row's name in the table (default external)")
    p.add_argument("--url-model", default="bench", help="the model name sent to it (default bench)")
    p.add_argument("--only-url", action="store_true", help="with --url: leave out the one-at-a-time server "
                                                           "(--url's server and continuous batching only)")
    args = p.parse_args(argv)
    if args.only_url and not args.url:
        p.error("--only-url needs --url")
    if args.url and args.url_name in ("continuous batching", "one at a time"):
        p.error(f"--url-name must differ from gpt2kit's rows, got {args.url_name!r}")
    args.url = args.url.rstrip("/") if args.url else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    extra = tuple(args.serve_args.split())

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from gpt2kit.checkpoint import save_model
            from gpt2kit.model import GPT2

            model_dir = os.path.join(tmp, args.preset)
            save_model(GPT2.from_name(args.preset), model_dir)
        procs, servers = [], {}  # servers: row name -> (URL, model name), in the order each round runs them
        try:
            kinds = {"continuous batching": args.clients} if args.only_url else \
                {"continuous batching": args.clients, "one at a time": 1}
            for k, max_batch in kinds.items():
                proc, url = _start(model_dir, max_batch, args.clients, args.threads, extra)
                procs.append(proc)
                servers[k] = (url, "bench")
            if args.url:
                servers[args.url_name] = (args.url, args.url_model)
            runs: dict[str, list[dict]] = {k: [] for k in servers}
            for url, model in servers.values():  # warm-up (first-use allocations, packing)
                asyncio.run(_load(url, 2, 2, 100.0, 4, seed=0, model=model))
            for rnd in range(args.rounds):
                for k, (url, model) in servers.items():
                    r = asyncio.run(_load(url, args.requests, args.clients, args.rate, args.max_tokens, seed=rnd,
                                          model=model, to_the_end=IGNORE_EOS if args.ignore_eos else BAN_EOT))
                    runs[k].append(r)
                    print(f"round {rnd + 1} {k}: {r['tok_per_s']:.1f} tok/s, {r['failed']} failed", file=sys.stderr)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(30)

    print(f"# bench_serve: {args.model or args.preset + ' (random weights)'}, {args.clients} clients, "
          f"{args.requests} requests x {args.max_tokens} tokens, Poisson {args.rate}/s, {args.rounds} rounds, "
          f"serve flags: {args.serve_args or '(none)'}; "
          f"to the end by {'ignore_eos' if args.ignore_eos else 'logit_bias'}"
          + (f"; {args.url_name}: {args.url} (model {args.url_model})" if args.url else ""))
    print(f"# CPU: {describe_cpu()}; torch threads: {args.threads or 'default'}; "
          f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    print("| server | req/s | tok/s | TTFT mean / median / p99 (ms) | sent-TTFT mean / median / p99 (ms) | "
          "TPOT mean / median / p99 (ms) | ITL mean / median / p99 (ms) | failed |")
    print("|---|---|---|---|---|---|---|---|")
    best = {}
    for k, rs in runs.items():
        r = max(rs, key=lambda x: x["tok_per_s"])  # best round of each (the least disturbed)
        best[k] = r
        ms = lambda s: f"{1e3 * s['mean']:.0f} / {1e3 * s['median']:.0f} / {1e3 * s['p99']:.0f}"  # noqa: E731
        print(f"| {k} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} | {ms(r['ttft'])} | {ms(r['sent_ttft'])} | "
              f"{ms(r['tpot'])} | "
              f"{ms(r['itl'])} | {sum(x['failed'] for x in rs)} |")
    ratios = {f"continuous batching / {k}": best["continuous batching"]["tok_per_s"] / best[k]["tok_per_s"]
              if best[k]["tok_per_s"] else float("nan") for k in best if k != "continuous batching"}
    print()
    for name, ratio in ratios.items():
        print(f"{name}, token throughput: {ratio:.2f}x")
    if args.json:
        from gpt2kit._io import atomic_write_text

        atomic_write_text(args.json, json.dumps({"args": vars(args), "runs": runs, "ratios": ratios,
                                                 "ratio": ratios.get("continuous batching / one at a time"),
                                                 "cpu": describe_cpu()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
