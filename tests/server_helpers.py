"""What the server tests share: the served model's tokenizer and template, engine options,
a live uvicorn server in a thread, and polls of its engine.

The session fixtures built from these live in tests/conftest.py (one engine build for every
server test file). This module imports uvicorn and httpx: only server tests import it."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from loopjax.metrics import parse

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["hello", "world", "user", "assistant", "system", "the", "loop", "model"]
MODEL_NAME = "ouro-tiny"
# Small buckets keep start-up compilation short on CI's CPU: 16 rows for 16 concurrent requests.
SERVER_ENGINE = dict(max_num_rows=16, decode_row_buckets=(16,), max_prefill_tokens=64,
                     prefill_token_buckets=(64,), max_prefill_rows=4, max_logprobs=2,
                     enable_prefix_caching=True, verbose=False)
REF_ENGINE = dict(max_num_rows=2, decode_row_buckets=(2,), max_prefill_tokens=32,
                  prefill_token_buckets=(32,), max_prefill_rows=2, verbose=False)
PREFIX_METRICS = ("loopjax_prefix_cache_enabled", "loopjax_prefix_cache_hit_rate",
                  "loopjax_prefix_cache_page_hit_rate", "loopjax_prefix_cache_pages",
                  "loopjax_prefix_cache_parked_pages", "loopjax_prefix_cache_evictions_total",
                  "loopjax_prefix_cache_queried_tokens_total", "loopjax_prefix_cache_hit_tokens_total",
                  "loopjax_prefix_cache_queried_pages_total", "loopjax_prefix_cache_hit_pages_total")


def word_tokenizer(vocab_size: int):
    """Word-level tokenizer: 0 <unk>, 1 <|im_start|>, 2 <|im_end|> (Ouro tiny's EOS), then words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = WORDS + [f"w{i}" for i in range(vocab_size - 3 - len(WORDS))]
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2} | {w: i + 3 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


class LiveServer:
    """`app` served by uvicorn in a daemon thread on a free port of 127.0.0.1 (a context manager)."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "server did not shut down"


def wait_idle(aengine, timeout_s=30):
    """Poll the engine stats until nothing runs and no page is used; returns the stats."""
    deadline = time.time() + timeout_s
    while True:
        stats = aengine.stats()
        if stats["pages_used"] == 0 and stats["running_rows"] == 0 and stats["queue_len"] == 0:
            return stats
        assert time.time() < deadline, f"engine not idle: {stats}"
        time.sleep(0.05)


def scrape_metrics(server) -> dict:
    """The server's /metrics, parsed into {sample name: value}."""
    return parse(httpx.get(server.url + "/metrics", timeout=10).text)
