"""Launching the distributed test scenarios: N worker processes of one script on gloo (or NCCL), each
one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), rank 0 writing the results to a file."""

import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(script: str, out, world: int = 2, timeout: int = 240) -> None:
    """Run `tests/<script> OUT` as `world` ranks; fail with their output unless all succeed."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    workers = [
        subprocess.Popen([sys.executable, os.path.join(HERE, script), str(out)], env=dict(env, RANK=str(rank)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(world)
    ]
    outputs = [worker.communicate(timeout=timeout)[0] for worker in workers]
    assert all(worker.returncode == 0 for worker in workers), "\n".join(outputs)[-6000:]


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
