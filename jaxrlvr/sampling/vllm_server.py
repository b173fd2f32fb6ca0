"""Starts and supervises a vLLM OpenAI-compatible server for rollouts.

`VLLMServer` runs ``python -m vllm.entrypoints.openai.api_server`` as a child process (optionally
from a different Python environment, since vLLM pins its own torch and transformers), with the
flags that per-step weight reload needs:

- env ``VLLM_SERVER_DEV_MODE=1``: enables ``/pause``, ``/resume``, ``/collective_rpc`` (used for
  ``reload_weights``), ``/reset_prefix_cache`` and ``/update_weight_version``. These endpoints run
  methods on the workers, so the server binds to 127.0.0.1; a non-loopback address is refused
  (:func:`check_bind_host`) unless the caller passes ``allow_remote_dev_endpoints=True``
  (``--allow-remote-dev-endpoints``); never expose a dev-mode server on a shared network.
- ``--logprobs-mode processed_logprobs``: returned logprobs are those of the distribution that was
  sampled from (after temperature, top-k, top-p), which is what importance ratios need; vLLM's
  default (``raw_logprobs``) returns pre-temperature values.
- on the CPU (``device="cpu"``, the default): ``--enforce-eager``, ``--dtype float32`` (float32
  logprobs match the trainer's) and a fixed KV cache (``--kv-cache-memory-bytes``);
- on GPUs (``device="cuda"``): the server sees only its own GPUs (``CUDA_VISIBLE_DEVICES`` =
  ``gpus``), shards the model over them (``--tensor-parallel-size`` = ``len(gpus)``), takes
  ``--gpu-memory-utilization`` of each GPU's memory for weights, activations and KV cache, runs
  in ``--dtype bfloat16`` and keeps CUDA graphs (no ``--enforce-eager``).

Which GPUs each server gets, and what the trainer's JAX keeps, is decided by `jaxrlvr.placement`.

`serve_vllm_main(argv)` is the body of ``jaxrlvr serve-vllm``. Not here: the HTTP client and weight
sync (`vllm_sampler`), and installing vLLM (``scripts/setup_vllm.sh``).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence

import httpx

from jaxrlvr import placement
from jaxrlvr.sampling import base as sampling_base
from jaxrlvr.sampling.bind import UnsafeBindError, check_bind_host, is_loopback  # noqa: F401

DEFAULT_KV_CACHE_BYTES = 64 * 1024**2
PYTHON_ENV = "JAXRLVR_VLLM_PYTHON"  # the interpreter with vLLM, when none is given
SERVED_MODEL_NAME = "jaxrlvr-policy"

# Servers run in their own process group (so that stop() reaches vLLM's engine processes), which
# also means they outlive an interpreter that exits without stopping them; stop them at exit.
# A parent that dies without running atexit (SIGKILL, OOM killer) is covered by the watchdog below.
_LIVE: weakref.WeakSet = weakref.WeakSet()

# A watchdog process outlives the trainer only to stop the server: it polls its parent (the
# trainer) and the server's process group once a second; when the trainer is gone it SIGTERMs the
# group (SIGKILL 15 s later); when the server is gone it exits. (No preexec_fn or prctl: forking
# with a preexec_fn from a multithreaded process such as JAX's is deadlock-prone.)
_WATCHDOG = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
def group_alive():
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
while group_alive():
    if os.getppid() != parent:
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while group_alive() and time.monotonic() < deadline:
                time.sleep(0.2)
        break
    time.sleep(1.0)
"""


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        try:
            server.stop(timeout_s=10.0)
        except Exception:
            pass


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS may hand it out again; good enough here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: str, lines: int = 40) -> str:
    """Last `lines` lines of a log file ('' when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(collections.deque(f, maxlen=lines))
    except OSError:
        return ""


# vLLM's log prefix, e.g. "(EngineCore pid=7) ERROR 12-02 07:03:07 [core.py:1512] ".
_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(\w+ \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] )?")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit)): \S")
_LEVELS = ("ERROR", "CRITICAL")


def root_cause(log_text: str) -> str | None:
    """The first exception line of a server log (a crash's root cause), without vLLM's prefix:
    wrappers that point elsewhere ("See stack trace (above) for the root cause") are passed over,
    and of prefixed lines only ERROR / CRITICAL ones count. None when the log shows none."""
    for line in log_text.splitlines():
        prefix = _LOG_PREFIX.match(line)
        text = line[prefix.end() :].strip()
        level = (prefix.group(2) or "").split(" ")[0]
        if prefix.group(2) and level not in _LEVELS:
            continue
        if level in _LEVELS and text.startswith("[") and "] " in text:  # "[file.py:12] ..."
            text = text.split("] ", 1)[1]
        if not _EXCEPTION_LINE.match(text):
            continue
        if "root cause" in text or "stack trace" in text:
            continue
        return text
    return None


# The ranks vLLM 0.32 accepts for ``--max-lora-rank`` (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_server_args(rank: int, max_loras: int = 2) -> list[str]:
    """The api_server flags that serve LoRA adapters of rank <= ``rank``: ``--max-lora-rank`` is
    the smallest rank vLLM accepts that holds it."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"lora rank {rank}: vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")
    return ["--enable-lora", "--max-lora-rank", str(fits[0]), "--max-loras", str(max_loras)]


def server_python(python: str | None = None) -> tuple[str, str]:
    """(the interpreter that runs a server, where it came from): ``python`` ("given"), else
    ``$JAXRLVR_VLLM_PYTHON`` (``PYTHON_ENV``), else this interpreter ("this interpreter")."""
    if python:
        return python, "given"
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV], PYTHON_ENV
    return sys.executable, "this interpreter"


class VLLMServer:
    """A vLLM server child process on one model directory.

    Args:
      model_dir: a Hugging Face model directory (config.json, safetensors, tokenizer files).
      python: interpreter of the environment where vLLM is installed (defaults to env
        ``JAXRLVR_VLLM_PYTHON``, else this interpreter).
      host: bind address; 127.0.0.1 by default because dev mode exposes worker RPC; a
        non-loopback address raises `UnsafeBindError` unless `allow_remote_dev_endpoints`.
      allow_remote_dev_endpoints: accept a non-loopback `host` (trusted networks only).
      port: TCP port; 0 picks a free one.
      max_model_len: longest prompt + completion the server accepts.
      dtype: model dtype on the server (default: float32 on the CPU, bfloat16 on GPUs).
      kv_cache_bytes: KV-cache size (``--kv-cache-memory-bytes``; CPU only: on GPUs the cache
        takes what `gpu_memory_utilization` leaves after weights and activations).
      device: "cpu" (the CPU build of vLLM, eager) or "cuda" (GPUs, CUDA graphs).
      gpus: on "cuda", the GPUs this server gets (entries of the launcher's
        ``CUDA_VISIBLE_DEVICES``: indices or UUIDs); the model is split over them with tensor
        parallelism. Empty: the inherited ``CUDA_VISIBLE_DEVICES`` and one GPU.
      gpu_memory_utilization: on "cuda", the fraction of each GPU's memory the server may take.
      tokenizer: tokenizer directory; defaults to `model_dir`, and is kept across `restart` so
        that a restart can point `model_dir` at a weights-only export.
      extra_args: more command-line flags for the api_server.
      lora_rank: serve LoRA adapters of rank up to this (``--enable-lora``, ``--max-lora-rank``
        rounded up to a rank vLLM accepts, ``--max-loras 2``: the current adapter and the next
        one while it loads) and allow loading them at run time (env
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); `VLLMSampler` then syncs adapters only. None: no
        LoRA.
      log_path: where the server's stdout/stderr go (a temp file by default).
      startup_timeout_s: how long `start` waits for ``/health``.
      start: start the process at construction.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        python: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_model_len: int = 512,
        dtype: str | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        device: str = "cpu",
        gpus: Sequence[int | str] = (),
        gpu_memory_utilization: float = placement.DEFAULT_GPU_MEMORY_UTILIZATION,
        tokenizer: str | os.PathLike | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike | None = None,
        startup_timeout_s: float = 300.0,
        start: bool = True,
        allow_remote_dev_endpoints: bool = False,
        lora_rank: int | None = None,
    ):
        check_bind_host(
            host,
            allow_remote_dev_endpoints,
            key="VLLMServer: host",
            allow_flag="allow_remote_dev_endpoints=True",
        )
        if device not in placement.DEVICES:
            raise ValueError(f"VLLMServer: device={device!r}; expected one of {placement.DEVICES}")
        if gpus and device != "cuda":
            raise ValueError(f"VLLMServer: gpus={list(gpus)!r} needs device='cuda'")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"VLLMServer: gpu_memory_utilization={gpu_memory_utilization!r}; expected (0, 1]"
            )
        self.device = device
        self.gpus = tuple(str(g) for g in gpus)
        self.gpu_memory_utilization = float(gpu_memory_utilization)
        self.model_dir = os.fspath(model_dir)
        self.python = server_python(python)[0]
        self.host = host
        self.port = port or pick_free_port(host if host not in ("0.0.0.0", "::") else "127.0.0.1")
        self.max_model_len = max_model_len
        self.dtype = dtype or placement.DEFAULT_DTYPE[device]
        self.kv_cache_bytes = kv_cache_bytes
        self.tokenizer = os.fspath(tokenizer) if tokenizer is not None else self.model_dir
        self.extra_args = tuple(extra_args)
        self.lora_rank = lora_rank
        self._lora_args = lora_server_args(lora_rank) if lora_rank is not None else []
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="jaxrlvr-vllm-", suffix=".log")
            os.close(fd)
        self.log_path = os.fspath(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None
        self._log_start = 0
        if start:
            self.start()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def tensor_parallel_size(self) -> int:
        return max(1, len(self.gpus))

    def command(self) -> list[str]:
        """The api_server command line (CPU: eager, fixed KV cache; GPU: see the class doc)."""
        if self.device == "cpu":
            memory = ["--kv-cache-memory-bytes", str(self.kv_cache_bytes), "--enforce-eager"]
        else:
            memory = [
                "--tensor-parallel-size",
                str(self.tensor_parallel_size),
                "--gpu-memory-utilization",
                str(self.gpu_memory_utilization),
            ]
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--tokenizer",
            self.tokenizer,
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            *memory,
            "--logprobs-mode",
            "processed_logprobs",
            *self._lora_args,
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # JAX's fake-device flags and platform pins mean nothing to vLLM's torch; drop them.
        env.pop("XLA_FLAGS", None)
        env.update(
            VLLM_TARGET_DEVICE=env.get("VLLM_TARGET_DEVICE", "cpu"),
            VLLM_SERVER_DEV_MODE="1",
            VLLM_HOST_IP=env.get("VLLM_HOST_IP", "127.0.0.1"),
            HF_HUB_OFFLINE="1",
        )
        if self.lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.device == "cuda":
            env["VLLM_TARGET_DEVICE"] = "cuda"
            # The trainer's JAX memory settings are not the server's business.
            for key in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE"):
                env.pop(key, None)
            if self.gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        return env

    def start(self) -> None:
        """Launches the process and blocks until ``/health`` answers 200."""
        if self.alive():
            return
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()  # this start's part of the log (``failure``)
            log.write(f"\n=== jaxrlvr: starting {' '.join(self.command())}\n".encode())
            log.flush()
            # A new session makes the server the leader of its own process group, so that stop()
            # (and the watchdog) also reach the EngineCore child it spawns.
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self._proc.pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _LIVE.add(self)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    cause = self.failure() or "no exception in its log"
                    raise sampling_base.SamplerError(
                        f"vLLM server exited with code {code} during start-up: {cause} (log: "
                        f"{self.log_path}; command: {' '.join(self.command())}); the log ends "
                        f"with:\n{log_tail(self.log_path)}"
                    )
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(
                        f"vLLM server at {self.url} not ready after {self.startup_timeout_s:.0f} s;"
                        " "
                        f"log {self.log_path} ends with:\n{log_tail(self.log_path)}"
                    )
                time.sleep(0.5)

    def failure(self) -> str | None:
        """The root-cause line (``root_cause``) of this start's part of the log, if any."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return root_cause(f.read().decode(errors="replace"))
        except OSError:
            return None

    def alive(self) -> bool:
        """True while the server process runs (says nothing about readiness)."""
        return self._proc is not None and self._proc.poll() is None

    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def stop(self, timeout_s: float = 20.0) -> None:
        """Terminates the server's process group: SIGTERM, then SIGKILL after `timeout_s`."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
        # The EngineCore child can outlive a leader that died first; sweep the group.
        self._signal_group(proc, signal.SIGKILL)
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.kill()
            watchdog.wait()

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """Kills the server abruptly (SIGKILL to its process group), as a crash would."""
        if self._proc is not None:
            self._signal_group(self._proc, signal.SIGKILL)
            self._proc.wait()

    def restart(self, model_dir: str | os.PathLike | None = None) -> None:
        """Stops the server (if running) and starts it again, on `model_dir` when given."""
        self.stop()
        if model_dir is not None:
            self.model_dir = os.fspath(model_dir)
        self.restarts += 1
        self.start()

    def __enter__(self) -> VLLMServer:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):
        try:
            self.stop(timeout_s=5.0)
        except Exception:
            pass


def start_servers(servers: Sequence[VLLMServer]) -> None:
    """Starts several servers at once (each takes a minute or more to load and, on GPUs, to
    capture CUDA graphs) and waits for all; if one fails, stops the others and re-raises."""
    if len(servers) == 1:
        servers[0].start()
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(servers)) as pool:
        futures = [pool.submit(s.start) for s in servers]
        concurrent.futures.wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]


def _comma_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU numbers like 0,1; got {text!r}") from None


def serve_vllm_main(argv: Sequence[str] | None = None) -> int:
    """``jaxrlvr serve-vllm --model DIR [--python PATH] [--port N] [--host H] [--device D]
    [--gpus 0,1] [--num-servers N] [--gpu-memory-utilization F] [--dtype T] [--lora-rank R]
    [vLLM flags]``.

    The options of ``sampler.vllm_*`` in a config: ``--gpus`` split into ``--num-servers`` equal
    groups, one server per group with ``--tensor-parallel-size`` = group size, on ports
    ``--port``, ``--port``+1, ...; default on GPUs: the first ``--num-servers`` GPUs, one each.
    Flags this command does not know go to every api_server (``sampler.vllm_extra_args``).
    Blocks until Ctrl-C (returns 0) or until a server dies (returns 1).
    """
    parser = argparse.ArgumentParser(
        prog="jaxrlvr serve-vllm",
        description="Start vLLM's OpenAI-compatible server(s) with the flags jaxrlvr's weight sync "
        "needs (dev mode, processed logprobs). Dev mode exposes worker RPC: keep the default "
        "host 127.0.0.1 unless the network is trusted.",
    )
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument(
        "--python",
        default=None,
        help="interpreter of the vLLM environment (default: $JAXRLVR_VLLM_PYTHON or this one)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="bind address (loopback only, unless the next flag)"
    )
    parser.add_argument(
        "--allow-remote-dev-endpoints",
        action="store_true",
        help="accept a non-loopback --host: the dev-mode endpoints let anyone who reaches the "
        "port run code on this machine (trusted networks only)",
    )
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cuda when GPUs are visible (and JAX_PLATFORMS does not say cpu), else cpu",
    )
    parser.add_argument(
        "--gpus",
        type=_comma_ints,
        default=(),
        help="GPU numbers (positions in CUDA_VISIBLE_DEVICES) for the servers, e.g. 0,1",
    )
    parser.add_argument("--num-servers", type=int, default=1, help="servers (GPU groups)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=placement.DEFAULT_GPU_MEMORY_UTILIZATION,
        help="fraction of each GPU's memory a server takes (GPU only)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="auto: float32 on the CPU, bfloat16 on GPUs",
    )
    parser.add_argument(
        "--kv-cache-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES, help="KV cache (CPU only)"
    )
    parser.add_argument(
        "--log", default=None, help="server log file (default: a temp file; .N added per server)"
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="serve LoRA adapters up to this rank, loaded at run time (a LoRA run's model.lora)",
    )
    args, extra = parser.parse_known_args(argv)
    check_bind_host(args.host, args.allow_remote_dev_endpoints)
    servers = plan_servers(args, extra, placement.host_gpus())
    # `kill PID` should stop the server too, not only Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Ctrl-C stops it even when started from a shell that ignores SIGINT for background jobs
    # (Python then inherits SIG_IGN and would never raise KeyboardInterrupt).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"jaxrlvr serve-vllm: starting {len(servers)} vLLM server(s) for {args.model} ...",
          flush=True)  # fmt: skip
    try:
        start_servers(servers)
        for s in servers:
            where = f" on GPU {','.join(s.gpus)}" if s.gpus else ""
            print(f"jaxrlvr serve-vllm: ready at {s.url}{where} (log {s.log_path})", flush=True)
        while all(s.alive() for s in servers):
            time.sleep(1.0)
        dead = next(s for s in servers if not s.alive())
        print(
            f"jaxrlvr serve-vllm: server {dead.url} exited with code {dead.returncode()}; log "
            f"ends with:\n{log_tail(dead.log_path)}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for s in servers:
            s.stop()


def plan_servers(
    args: argparse.Namespace, extra: Sequence[str], host_gpus: Sequence[str]
) -> list[VLLMServer]:
    """The (unstarted) servers ``serve-vllm`` runs for its parsed flags on a host with
    ``host_gpus`` (``CUDA_VISIBLE_DEVICES`` entries), as ``placement.plan_serve`` places them."""
    plan = placement.plan_serve(
        device=args.device,
        gpus=args.gpus,
        num_servers=args.num_servers,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        host=host_gpus,
    )
    servers = []
    for i, gpus in enumerate(plan.server_gpus):
        log = args.log if args.log is None or i == 0 else f"{args.log}.{i}"
        servers.append(
            VLLMServer(
                args.model,
                python=args.python,
                host=args.host,
                port=args.port + i if args.port else 0,
                max_model_len=args.max_model_len,
                dtype=plan.dtype,
                kv_cache_bytes=args.kv_cache_bytes,
                device=plan.device,
                gpus=gpus,
                gpu_memory_utilization=plan.gpu_memory_utilization,
                extra_args=extra,
                log_path=log,
                allow_remote_dev_endpoints=args.allow_remote_dev_endpoints,
                start=False,
                lora_rank=args.lora_rank,
            )
        )
    return servers
