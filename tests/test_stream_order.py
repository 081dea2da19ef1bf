"""The copies' stream ordering, checked on CPU: CPU counterparts of the CUDA-only tests of
``tests/test_cuda_pipeline.py``.

On CUDA the link orders its copies with streams and events (``transfer.py``: a copy down
waits for the kernels queued before it, a copy up is waited for by the training stream,
``record_stream`` keeps a source's memory until its copy is done, a host job's copy queue
waits for what was queued before its launch and for nothing queued after). Those calls go
through one seam, ``transfer.CudaStreams``; here a recording fake takes its place, CPU
tensors play the device's, and every tensor op is logged with the stream it was issued
on (a ``TorchDispatchMode``). Removing any ordering call from ``transfer.py`` fails a test
here (tried for the copy-in's ``record_stream`` and the down copy's wait).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zenflow_triton import transfer

DEV = torch.device("cpu")


class Event:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def query(self) -> bool:  # a host wait (transfer.wait_event) polls this
        self.log.append(("host waits", self.name))
        return True

    def __repr__(self) -> str:
        return self.name


class RecordingStreams(transfer.CudaStreams):
    """Streams and events as names, every call logged in order: ``("wait", stream,
    event)``, ``("record", stream, event)``, ``("keep", tensor id, stream)``, and the ops
    issued inside ``use`` as ``("op", name, stream)`` (outside: stream ``"current"``)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.active = ["current"]
        self._events = 0
        self._streams = 0

    def owns(self, device: torch.device) -> bool:
        return True  # CPU tensors play the accelerator's

    def canonical(self, device: torch.device) -> torch.device:
        return device

    def new_stream(self, device: torch.device) -> str:
        self._streams += 1
        return f"copy{self._streams}"

    def current(self, device: torch.device) -> str:
        return "current"

    @contextlib.contextmanager
    def use(self, stream):
        self.active.append(stream)
        try:
            yield
        finally:
            self.active.pop()

    def record(self, stream) -> Event:
        self._events += 1
        ev = Event(self.log, f"e{self._events}")
        self.log.append(("record", stream, ev.name))
        return ev

    def wait(self, stream, event) -> None:
        self.log.append(("wait", stream, event.name))

    def keep_alive(self, t: torch.Tensor, stream) -> None:
        self.log.append(("keep", id(t), stream))


class OpLog(TorchDispatchMode):
    """Every tensor op, with the stream the fake says it was issued on."""

    def __init__(self, streams: RecordingStreams) -> None:
        super().__init__()
        self.streams = streams

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in ("empty", "view", "reshape", "_reshape_alias", "detach", "alias"):
            self.streams.log.append(("op", name, self.streams.active[-1]))
        return func(*args, **(kwargs or {}))


def _link() -> tuple[transfer.Link, RecordingStreams]:
    fake = RecordingStreams()
    return transfer.Link(streams=fake), fake


def _index(log: list, entry: tuple) -> int:
    assert entry in log, f"{entry} not in {log}"
    return log.index(entry)


def test_a_copy_down_waits_for_the_work_before_it_and_keeps_its_source():
    """``to_host_async``: the copy stream first waits for an event recorded on the current
    stream (the kernels that wrote the source), the copy runs on the copy stream, an event
    marks it done (what ``wait`` polls), and the source's memory is kept for the copy
    stream (``record_stream``)."""
    link, fake = _link()
    src = torch.arange(6.0)
    with OpLog(fake):
        out, wait = link.to_host_async(src)
    down = link._stream(DEV, "d2h")
    log = fake.log
    before = _index(log, ("record", "current", "e1"))
    waited = _index(log, ("wait", down, "e1"))
    copied = _index(log, ("op", "copy_", down))
    done = _index(log, ("record", down, "e2"))
    kept = _index(log, ("keep", id(src), down))
    assert before < waited < copied < done < kept
    assert ("op", "copy_", "current") not in log  # nothing crossed on the training stream
    wait(1.0)
    assert log[-1] == ("host waits", "e2")
    assert torch.equal(out, src)


def test_a_copy_up_is_waited_for_by_the_training_stream():
    """``to_device_async``: the copy runs on the up stream, an event marks it, the training
    stream waits for that event (on the device: no host wait) and keeps the result's
    memory until its own work is done."""
    link, fake = _link()
    src = torch.arange(4.0)
    with OpLog(fake):
        out = link.to_device_async(src, DEV)
    up = link._stream(DEV, "h2d")
    log = fake.log
    done = _index(log, ("record", up, "e1"))
    waited = _index(log, ("wait", "current", "e1"))
    kept = _index(log, ("keep", id(out), "current"))
    assert done < waited < kept
    assert not [e for e in log if e[0] == "host waits"]
    assert up != link._stream(DEV, "d2h")  # a copy up never queues behind a copy down


def test_a_copy_in_divides_copies_and_zeroes_on_the_down_stream_in_order():
    """A host job's copy-in: after the down stream waits for the work queued before the
    launch, each source is divided (the window mean), copied and zeroed there, in that
    order, its memory kept for that stream; one event marks the copies; the job's thread
    waits for it on the host, and ``release`` makes the training stream wait for it on the
    device before it writes a source again (once)."""
    link, fake = _link()
    acc = torch.full((3, 2), 4.0)
    dst = torch.empty(6)
    with OpLog(fake):
        copy_in = transfer.CopyIn(link, [(dst, acc, True, 2.0)])
    down = link._stream(DEV, "d2h")
    log = fake.log
    waited = _index(log, ("wait", down, "e1"))
    assert log.index(("record", "current", "e1")) < waited
    ops = [e[1] for e in log if e[0] == "op" and e[2] == down]
    assert ops == ["div_", "copy_", "zero_"], log
    assert not [e for e in log if e[0] == "op" and e[2] == "current"], log
    kept = _index(log, ("keep", id(acc), down))
    done = _index(log, ("record", down, "e2"))
    assert waited < kept < done
    copy_in.wait_on_host(1.0)
    assert log[-1] == ("host waits", "e2")
    copy_in.release()
    copy_in.release()
    assert log.count(("wait", "current", "e2")) == 1
    assert torch.equal(dst, torch.full((6,), 2.0)) and not acc.any()


def test_a_copy_queue_waits_for_work_before_its_launch_and_not_after():
    """A host job's ``CopyQueue``: made at launch, it records an event on the training
    stream and makes both copy streams wait for it; work the training thread queues later
    (another event recorded there) is never waited for. Its copies run on the copy
    streams; ``wait_launched`` waits on the host for the launch event only; ``flush``
    waits for the streams it used."""
    link, fake = _link()
    with OpLog(fake):
        queue = link.copy_queue([DEV], timeout=1.0)
        later = fake.record("current")  # the training loop goes on after the launch
        dst, src = torch.zeros(4), torch.arange(4.0)
        queue.copy(dst, src)
        queue.wait_launched()
        queue.flush()
    up, down = link._stream(DEV, "h2d"), link._stream(DEV, "d2h")
    log = fake.log
    launched = _index(log, ("record", "current", "e1"))
    assert launched < _index(log, ("wait", down, "e1"))
    assert launched < _index(log, ("wait", up, "e1"))
    assert not [e for e in log if e[0] == "wait" and e[2] == later.name], log
    copied = _index(log, ("op", "copy_", up))
    assert copied > log.index(("wait", up, "e1"))
    host_waits = [e[1] for e in log if e[0] == "host waits"]
    assert "e1" in host_waits and later.name not in host_waits
    flushed = [e for e in log if e[0] == "record" and e[1] == up]
    assert flushed and log.index(flushed[-1]) > copied  # the flush's event after the copy
    assert torch.equal(dst, src)


def test_plain_cpu_copies_use_no_stream():
    """The real seam on a CPU-only run: no stream, no event; copies made at once."""
    link = transfer.Link()
    assert not link.streams.owns(DEV)
    src = torch.arange(3.0)
    out, wait = link.to_host_async(src)
    wait(0.0)
    assert torch.equal(out, src) and not link._streams


def test_an_outbox_is_rewritten_only_after_the_copy_that_reads_it():
    """Pinned-buffer reuse (issue 49): the apply copies an outbox to the device without
    blocking; the next job writes its results into the same outbox only after waiting for
    the work queued on the training stream before its launch (which includes the training
    stream's wait for that copy). Without that wait a result would overwrite the outbox
    while the last apply's copy still reads it."""
    from zenflow_triton.host.pipeline import _outbox_store

    calls: list[str] = []

    class Queue:  # the job's CopyQueue, recording the order of its calls
        def wait_launched(self) -> None:
            calls.append("wait for the work queued before the launch")

        def copy(self, dst, src) -> None:
            calls.append("write the outbox")
            dst.copy_(src)

    box, master = torch.zeros(8), torch.arange(8.0)
    store = _outbox_store(Queue(), box, master)
    store(0, 4)
    store(4, 8)
    assert calls == ["wait for the work queued before the launch", "write the outbox"] * 2
    assert torch.equal(box, master)


def test_a_staging_buffer_is_not_relaunched_while_its_job_reads_it():
    """The staging buffers (written by a job's copy-in, read by its host AdamW) are reused by
    the next window's job only after this one was waited for: launching over a job in
    flight is refused."""
    import pytest

    from zenflow_triton.host.adamw import HostHyper
    from zenflow_triton.host.pipeline import HostPipeline, Window
    from zenflow_triton.config import ZenFlowConfig

    link = transfer.Link()
    pipe = HostPipeline.for_config(link, ZenFlowConfig(host_threads=1))
    try:
        n = 16
        w = Window("p", torch.zeros(2, n), torch.zeros(2, n), torch.zeros(2, n),
                   HostHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                             step=1), "device_acc", torch.ones(2, n))
        pipe.launch([w], apply_now=False, label="window 1")
        with pytest.raises(AssertionError, match="still in flight"):
            pipe.launch([w], apply_now=False, label="window 2")
        pipe.wait()
        pipe.launch([w], apply_now=False, label="window 2")  # after the wait: fine
        pipe.wait()
    finally:
        pipe.worker.close()
        pipe.adamw.close()
