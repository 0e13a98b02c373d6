"""Launching the distributed test scenarios: N worker processes of one script on gloo (or NCCL), each
one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), rank 0 writing the results to a file.

`Background`: subprocesses a test module declares and its fixture waits for, started by conftest.py
while the tests before them run, on the CPU those tests leave idle.
"""

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_environment(world: int) -> dict:
    """The environment of `world` ranks on this machine (a free port, one thread each), qtensor importable."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    return env


def launch(script: str, out, world: int = 2, timeout: int = 240) -> None:
    """Run `tests/<script> OUT` as `world` ranks; fail with their output unless all succeed."""
    env = _rank_environment(world)
    workers = [
        subprocess.Popen([sys.executable, os.path.join(HERE, script), str(out)], env=dict(env, RANK=str(rank)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(world)
    ]
    outputs = [worker.communicate(timeout=timeout)[0] for worker in workers]
    assert all(worker.returncode == 0 for worker in workers), "\n".join(outputs)[-6000:]


def rank_commands(script: str, world: int = 2):
    """For `Background`: `world` ranks of `tests/<script> OUT`, OUT being results.pt in the run's folder."""

    def commands(folder: pathlib.Path) -> list:
        env = _rank_environment(world)
        return [([sys.executable, os.path.join(HERE, script), str(folder / "results.pt")], dict(env, RANK=str(rank))) for rank in range(world)]

    return commands


class Background:
    """Subprocesses that a test module declares at import and one of its fixtures waits for.

    The test process leaves much of the CPU idle (one thread between torch's parallel regions):
    conftest.py starts the runs the selected tests use (those whose tests request `fixture`) early,
    one at a time, each when the one before has exited, in the order the tests need them; a run
    not started when its fixture asks starts then. Early runs take idle CPU only (SCHED_IDLE,
    inherited by what they start): a process competing at the same priority with torch's threads
    in the test process makes its parallel regions wait for a descheduled thread, and slows the
    tests several times over. Once the fixture waits for it, a run still going is given the normal
    priority back, or, where the system refuses that, started again at the normal priority (so it
    never waits on CPU that other processes take). What the tests check is unchanged: the same
    processes, the same outputs, only sooner.

    `commands(folder)` gives the [(argv, env)] or [(argv, env, cwd)] to start together, `folder`
    being a fresh temporary folder of the run's own; `prepare(folder)`, if given, runs first in the
    test process (it writes what the processes read) and its return value is kept as `prepared`.
    `timeout` counts from the fixture's wait (an early run may have waited for idle CPU before)."""

    def __init__(self, fixture: str, commands, timeout: float, prepare=None):
        self.fixture, self.commands, self.timeout, self.prepare = fixture, commands, timeout, prepare
        self.processes, self.completed, self.prepared = None, None, None

    def start(self, idle: bool = False) -> None:
        """Start the processes (once); `idle`: at the idle scheduling priority."""
        if self.processes is not None:
            return
        self.folder = pathlib.Path(tempfile.mkdtemp(prefix=f"qtensor-{self.fixture}-"))
        if self.prepare is not None:
            import torch

            with torch.random.fork_rng(devices=[]):  # it may run between two tests: leave them torch's generator as it was
                self.prepared = self.prepare(self.folder)
        self.processes = []
        for argv, env, *cwd in self.commands(self.folder):
            # Output to files, not pipes: nobody reads a pipe before the fixture asks, and a full one would stall the process.
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            process = subprocess.Popen(argv, env=env, cwd=cwd[0] if cwd else None, stdout=out, stderr=err, text=True)
            self.processes.append((argv, process, out, err))
            if idle:
                os.sched_setscheduler(process.pid, os.SCHED_IDLE, os.sched_param(0))

    def running(self) -> bool:
        return self.processes is not None and self.completed is None and any(p.poll() is None for _, p, _, _ in self.processes)

    def wait(self) -> list:
        """Start the run if it has not started, wait for it: a CompletedProcess per command."""
        self.start()
        if self.completed is None:
            if not all(_normal_priority(process.pid) for _, process, _, _ in self.processes):
                self.stop()
                self.processes = None
                self.start()
            deadline = time.monotonic() + self.timeout
            for _, process, _, _ in self.processes:
                while process.poll() is None:
                    for _, other, _, _ in self.processes:  # again each second: what they started meanwhile too
                        _normal_priority(other.pid)
                    try:
                        process.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                    except subprocess.TimeoutExpired:
                        if time.monotonic() >= deadline:
                            self.stop()
                            raise
            self.completed = []
            for argv, process, out, err in self.processes:
                out.seek(0)
                err.seek(0)
                self.completed.append(subprocess.CompletedProcess(argv, process.returncode, out.read(), err.read()))
                out.close()
                err.close()
        return self.completed

    def results(self) -> pathlib.Path:
        """For `rank_commands`: wait, fail with the ranks' output unless all succeeded; the run's folder."""
        done = self.wait()
        assert all(d.returncode == 0 for d in done), "\n".join(d.stdout + d.stderr for d in done)[-6000:]
        return self.folder

    def stop(self) -> None:
        """Kill what still runs, what it started included (torchrun's ranks), and remove the folder."""
        for _, process, _, _ in self.processes or ():
            if process.poll() is None:
                for pid in reversed(dict.fromkeys(pid for pid, _ in _tree(process.pid))):  # the descendants first
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                process.wait()
        if self.processes is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _tree(pid: int):
    """(process id, thread id) of every thread of `pid` and of its descendants (Linux's /proc)."""
    pids = [pid]
    while pids:
        current = pids.pop()
        try:
            threads = os.listdir(f"/proc/{current}/task")
        except OSError:  # it exited
            continue
        for thread in threads:
            yield current, int(thread)
            try:
                with open(f"/proc/{current}/task/{thread}/children") as children:
                    pids += [int(child) for child in children.read().split()]
            except OSError:
                pass


def _normal_priority(pid: int) -> bool:
    """Undo the idle priority for every thread of `pid` and of its descendants. False if some
    thread stays at the idle priority (the system may refuse an unprivileged user)."""
    raised = True
    for _, thread in _tree(pid):
        try:
            if os.sched_getscheduler(thread) == os.SCHED_IDLE:
                os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))
        except PermissionError:
            raised = False
        except OSError:  # it exited
            pass
    return raised


class EarlyStarts:
    """conftest.py's schedule of `Background` runs: one running at a time, in the tests' order.
    Linux only (SCHED_IDLE, /proc); CPU runs only: on GPUs (QTENSOR_TEST_DEVICE=cuda) each run
    starts when its fixture asks."""

    def __init__(self):
        self.queue, self.runs = [], []
        self.enabled = hasattr(os, "SCHED_IDLE") and os.path.isdir("/proc/self/task") and os.environ.get("QTENSOR_TEST_DEVICE", "cpu") == "cpu"

    def collected(self, items) -> None:
        """The runs that the selected tests use, in the order of the first test to use each."""
        self.runs = []
        for item in items:
            module = getattr(item, "module", None)
            for value in vars(module).values() if module is not None else ():
                if isinstance(value, Background) and value.fixture in item.fixturenames and value not in self.runs:
                    self.runs.append(value)
        self.queue = list(self.runs) if self.enabled else []

    def next(self) -> None:
        """Start the next run unless one is running (called before each test)."""
        if any(run.running() for run in self.runs):
            return
        while self.queue:
            run = self.queue.pop(0)
            if run.processes is None:
                try:
                    run.start(idle=True)
                except Exception:  # its fixture starts it again, and fails in the tests that use it
                    run.stop()
                    run.processes = None
                    continue
                return

    def stop(self) -> None:
        for run in self.runs:
            run.stop()


def demo_rows(printed: str) -> dict:
    """The rows of the table `python -m qtensor.demo` prints: {recipe name: the fields after it}."""
    return {line[:26].strip(): line[26:].split() for line in printed.splitlines() if line[:1].isalpha() and line[26:27] == " "}


def worker_main(run) -> None:
    """A worker's `__main__`: `run(OUT)`, a traceback and exit code 1 on any failure."""
    code = 0
    try:
        run(sys.argv[1])
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # docs/design.md, FSDP2: a 2-process gloo run can abort at interpreter exit; leave without the teardown.
    os._exit(code)
