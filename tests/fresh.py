"""Run Python code as a fresh interpreter would, without paying for the imports each time.

Importing torch and qtensor takes about four seconds on the CI machine, and the docs and README
tests run some fifty blocks, each "in a fresh interpreter". Here one server process imports the
heavy modules once, runs no tensor operation, and forks a child per block. The child starts from
the server's memory: the same imported modules, no state any block made, a new `__main__`, its own
working directory, stdout and stderr. torch's thread pools are created lazily, so none exists yet
when the server forks.

What differs from `python -c`: the modules in `preload` are already imported (their import-time
side effects happened once, in the server) and the environment is the server's. A test about
import-time behaviour, or one that needs a different environment, uses a real subprocess.
"""

import atexit
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SERVERS = {}

# The server: imports `preload`, then for each request forks a child that runs the code.
_SERVER = r"""
import os, pickle, struct, sys, types, traceback, importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
requests, replies = os.fdopen(0, "rb", buffering=0), os.fdopen(1, "wb", buffering=0)

def read_exactly(n):
    data = b""
    while len(data) < n:
        chunk = requests.read(n - len(data))
        if not chunk:
            raise SystemExit(0)
        data += chunk
    return data

while True:
    code, args, cwd, out, err = pickle.loads(read_exactly(struct.unpack("<I", read_exactly(4))[0]))
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(os.open(out, os.O_WRONLY), 1)
        os.dup2(os.open(err, os.O_WRONLY), 2)
        os.chdir(cwd)
        sys.argv = ["-c", *args]
        sys.path[0] = ""  # as under `python -c`: the working directory first
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        status = 0
        try:
            exec(compile(code, "<string>", "exec"), main.__dict__)
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            status = 1
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)
    replies.write(struct.pack("<i", pid))
    _, status = os.waitpid(pid, 0)
    replies.write(struct.pack("<i", os.waitstatus_to_exitcode(status)))
"""


def _server(preload: tuple[str, ...]) -> subprocess.Popen:
    server = _SERVERS.get(preload)
    if server is None or server.poll() is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))}
        server = subprocess.Popen([sys.executable, "-c", _SERVER, *preload], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        _SERVERS[preload] = server
    return server


def _read(server: subprocess.Popen, size: int, timeout: float | None) -> bytes:
    data = b""
    while len(data) < size:
        if timeout is not None and not select.select([server.stdout], [], [], timeout)[0]:
            raise TimeoutError
        chunk = os.read(server.stdout.fileno(), size - len(data))
        if not chunk:
            raise RuntimeError("the fork server stopped; run the test again for its error")
        data += chunk
    return data


def run_python(code: str, *args: str, cwd=None, preload=("torch", "qtensor"), timeout: float = 300) -> subprocess.CompletedProcess:
    """`subprocess.run([python, "-c", code, *args], capture_output=True, text=True)`, forked from
    a server that has `preload` imported. The server finds qtensor from the repository root."""
    server = _server(tuple(preload))
    with tempfile.TemporaryDirectory() as scratch:
        out, err = os.path.join(scratch, "out"), os.path.join(scratch, "err")
        for path in (out, err):
            open(path, "w").close()
        request = pickle.dumps((code, list(args), str(cwd or os.getcwd()), out, err))
        server.stdin.write(struct.pack("<I", len(request)) + request)
        server.stdin.flush()
        (pid,) = struct.unpack("<i", _read(server, 4, 60))
        try:
            (status,) = struct.unpack("<i", _read(server, 4, timeout))
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            _read(server, 4, None)
            raise subprocess.TimeoutExpired(["python", "-c", code], timeout) from None
        with open(out) as stdout, open(err) as stderr:
            return subprocess.CompletedProcess(["python", "-c", code, *args], status, stdout.read(), stderr.read())


@atexit.register
def _stop_servers():
    for server in _SERVERS.values():
        server.stdin.close()
        server.wait(timeout=30)
