"""`./run` picks its environment: an active one is kept; otherwise it makes and reuses `.venv` in
the checkout, so that a system Python that refuses pip installs (PEP 668, Debian/Ubuntu) works.

Each test runs the real `run` script (and `.ci/run`) in a temporary copy of the checkout's minimal
files, with PYTHON pointing to a fake interpreter: a bash wrapper around the real one that logs
every call, answers `-m pip` / `-m pytest` / `-m qtensor.demo` itself (no network, no installs),
refuses `pip install` outside a virtual environment like an externally managed Python, says
whether torch imports from its FAKE_TORCH setting, and makes real (pip-less) venvs whose
interpreters are the same wrapper. Every other call goes to the real Python, so the
`sys.prefix != sys.base_prefix` check is genuine.
"""

import os
import pathlib
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
REAL_PYTHON = getattr(sys, "_base_executable", None) or os.path.realpath(sys.executable)

pytestmark = pytest.mark.skipif(os.name != "posix" or shutil.which("bash") is None, reason="needs bash")

FAKE_PYTHON = r"""#!/usr/bin/env bash
# Fake interpreter for tests/test_run_script.py (see its docstring).
here=$(cd "$(dirname "$0")" && pwd)
if [ -f "$here/../pyvenv.cfg" ]; then
    where=venv; venv=$(cd "$here/.." && pwd); real="$here/python-real"
else
    where=base; venv=""; real="@REAL@"
fi
echo "$where $*" >> "$FAKE_LOG"
has_torch() {
    if [ "$where" = base ]; then [ "${FAKE_TORCH:-0}" = 1 ]; return; fi
    [ -e "$venv/fake-torch" ] && return 0
    grep -q "include-system-site-packages = true" "$venv/pyvenv.cfg" && [ "${FAKE_TORCH:-0}" = 1 ]
}
case "${1:-}" in
    -c)
        case "${2:-}" in *torch*) has_torch; exit ;; esac ;;
    -m)
        case "${2:-}" in
            pip)
                if [ "${3:-}" = install ]; then
                    if [ "$where" = base ] && [ "${FAKE_PEP668:-1}" = 1 ]; then
                        echo "error: externally-managed-environment" >&2; exit 1
                    fi
                    for a in "$@"; do case "$a" in torch|torch==*) [ -n "$venv" ] && touch "$venv/fake-torch" ;; esac; done
                fi
                exit 0 ;;
            venv)
                [ "${FAKE_NO_VENV:-0}" = 1 ] && { mkdir -p "${!#}/bin"; echo "Error: ensurepip is not available" >&2; exit 1; }
                shift 2
                "$real" -m venv --without-pip "$@" || exit
                dir="${!#}"
                ln -s "@REAL@" "$dir/bin/python-real"
                for name in python python3; do rm -f "$dir/bin/$name"; cp "$0" "$dir/bin/$name"; done
                exit 0 ;;
            pytest) echo "fake pytest: $where ${*:3}"; exit "${FAKE_PYTEST_RC:-0}" ;;
            qtensor.demo) echo "fake demo: $where ${*:3}"; exit 0 ;;
        esac ;;
esac
exec "$real" "$@"
"""


@pytest.fixture
def tree(tmp_path):
    """A copy of the files `./run` and `.ci/run` need, and a fake interpreter outside it."""
    work = tmp_path / "checkout"
    (work / ".ci").mkdir(parents=True)
    for name in ("run", ".ci/run", "pyproject.toml"):
        shutil.copy2(ROOT / name, work / name)
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir()
    fake = fakebin / "python3"
    fake.write_text(FAKE_PYTHON.replace("@REAL@", REAL_PYTHON))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return work, fake, tmp_path / "calls.log"


def run(tree, *args, script="run", **env_overrides):
    work, fake, log = tree
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "QTENSOR_VENV", "PYTHON")}
    env.update(PYTHON=str(fake), FAKE_LOG=str(log))
    env.update(env_overrides)
    if log.exists():
        log.unlink()
    done = subprocess.run(["bash", script, *args], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return done, calls


def env_lines(done):
    return [line for line in done.stderr.splitlines() if line.startswith("./run:")]


def cpu_or_gpu_torch():
    return "torch" if shutil.which("nvidia-smi") else "torch==2.13.0"


def test_no_environment_makes_venv_and_uses_it(tree):
    """The issue: on an externally managed Python, `./run test` failed at once with PEP 668."""
    work, _, _ = tree
    done, calls = run(tree, "test", "-k", "x", FAKE_TORCH="1", FAKE_PYTEST_RC="3")
    assert "externally-managed-environment" not in done.stderr, done.stderr
    assert done.returncode == 3, done.stderr  # pytest's exit code (exec)
    assert (work / ".venv" / "pyvenv.cfg").is_file()
    assert not any(c.startswith("base -m pip install") for c in calls), calls
    assert "venv -m pip install -q --root-user-action=ignore -e .[test]" in calls, calls
    assert done.stdout.strip() == "fake pytest: venv -q tests -k x"
    lines = env_lines(done)
    assert len(lines) == 1 and ".venv" in lines[0] and "rm -rf .venv" in lines[0], done.stderr


def test_base_torch_is_reused_through_system_site_packages(tree):
    work, _, _ = tree
    done, calls = run(tree, "test", FAKE_TORCH="1")
    assert done.returncode == 0, done.stderr
    assert "include-system-site-packages = true" in (work / ".venv" / "pyvenv.cfg").read_text()
    assert not any(c.startswith("venv -m pip install") and "torch" in c for c in calls), calls


def test_without_torch_venv_is_isolated_and_gets_the_cpu_pin(tree):
    work, _, _ = tree
    done, calls = run(tree, "test", FAKE_TORCH="0")
    assert done.returncode == 0, done.stderr
    assert "include-system-site-packages = false" in (work / ".venv" / "pyvenv.cfg").read_text()
    assert f"venv -m pip install -q {cpu_or_gpu_torch()}" in calls, calls


def test_gpu_machine_gets_plain_torch(tree, tmp_path):
    gpubin = tmp_path / "gpubin"
    gpubin.mkdir()
    smi = gpubin / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(0o755)
    done, calls = run(tree, "test", FAKE_TORCH="0", PATH=f"{gpubin}{os.pathsep}{os.environ['PATH']}")
    assert done.returncode == 0, done.stderr
    assert "venv -m pip install -q torch" in calls, calls


def test_rerun_reuses_venv_and_skips_pip(tree):
    work, _, _ = tree
    first, _ = run(tree, "test", FAKE_TORCH="0")
    assert first.returncode == 0, first.stderr
    cfg = (work / ".venv" / "pyvenv.cfg").stat()
    done, calls = run(tree, "test", FAKE_TORCH="0")
    assert done.returncode == 0, done.stderr
    assert not any(" -m venv" in c for c in calls), calls
    assert not any("-m pip install" in c for c in calls), calls
    assert (work / ".venv" / "pyvenv.cfg").stat().st_mtime_ns == cfg.st_mtime_ns
    assert done.stdout.strip() == "fake pytest: venv -q tests"
    lines = env_lines(done)
    assert len(lines) == 1 and ".venv" in lines[0], done.stderr


def test_changed_pyproject_installs_again_into_the_same_venv(tree):
    work, _, _ = tree
    assert run(tree, "test", FAKE_TORCH="0")[0].returncode == 0
    with open(work / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    done, calls = run(tree, "test", FAKE_TORCH="0")
    assert done.returncode == 0, done.stderr
    assert not any(" -m venv" in c for c in calls), calls
    assert "venv -m pip install -q --root-user-action=ignore -e .[test]" in calls, calls


def test_lost_torch_is_installed_again_despite_the_stamp(tree):
    work, _, _ = tree
    assert run(tree, "test", FAKE_TORCH="0")[0].returncode == 0
    (work / ".venv" / "fake-torch").unlink()
    done, calls = run(tree, "test", FAKE_TORCH="0")
    assert done.returncode == 0, done.stderr
    assert f"venv -m pip install -q {cpu_or_gpu_torch()}" in calls, calls


@pytest.mark.parametrize(
    "variable, words",
    [("VIRTUAL_ENV", "active virtual environment"), ("CONDA_PREFIX", "active conda environment")],
)
def test_active_environment_is_kept(tree, variable, words):
    work, fake, _ = tree
    done, calls = run(tree, "test", FAKE_PEP668="0", FAKE_TORCH="1", **{variable: "/some/env"})
    assert done.returncode == 0, done.stderr
    assert not (work / ".venv").exists()
    assert "base -m pip install -q --root-user-action=ignore -e .[test]" in calls, calls
    assert done.stdout.strip() == "fake pytest: base -q tests"
    lines = env_lines(done)
    assert len(lines) == 1 and words in lines[0] and "/some/env" in lines[0], done.stderr


def test_python_of_a_venv_is_used_directly(tree, tmp_path):
    work, fake, log = tree
    other = tmp_path / "otherenv"
    env = dict(os.environ, FAKE_LOG=str(log))
    subprocess.run([str(fake), "-m", "venv", str(other)], env=env, check=True)
    done, calls = run(tree, "demo", "--steps", "2", PYTHON=str(other / "bin" / "python"), FAKE_TORCH="0")
    assert done.returncode == 0, done.stderr
    assert not (work / ".venv").exists()
    assert done.stdout.strip() == "fake demo: venv --steps 2"
    assert (other / "fake-torch").exists()  # the torch install went into that environment
    assert "virtual environment" in env_lines(done)[0], done.stderr


def test_qtensor_venv_0_installs_into_python_itself(tree):
    work, _, _ = tree
    done, calls = run(tree, "test", QTENSOR_VENV="0", FAKE_PEP668="0", FAKE_TORCH="1")
    assert done.returncode == 0, done.stderr
    assert not (work / ".venv").exists()
    assert done.stdout.strip() == "fake pytest: base -q tests"
    assert "QTENSOR_VENV=0" in env_lines(done)[0], done.stderr


def test_demo_runs_in_the_venv(tree):
    done, _ = run(tree, "demo", "--steps", "2", FAKE_TORCH="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "fake demo: venv --steps 2"


@pytest.mark.parametrize("rc", [0, 1])
def test_ci_run_makes_the_venv_and_keeps_pytests_exit_code(tree, rc):
    work, _, _ = tree
    done, _ = run(tree, script=".ci/run", CI="true", FAKE_TORCH="1", FAKE_PYTEST_RC=str(rc))
    assert done.returncode == rc, done.stderr
    assert done.stdout.strip() == "fake pytest: venv -q tests"
    assert (work / ".venv" / "pyvenv.cfg").is_file()


def test_venv_that_cannot_be_made_is_explained_and_removed(tree):
    work, _, _ = tree
    done, _ = run(tree, "test", FAKE_NO_VENV="1", FAKE_TORCH="1")
    assert done.returncode != 0
    assert "python3-venv" in done.stderr and "QTENSOR_VENV=0" in done.stderr, done.stderr
    assert not (work / ".venv").exists()


def test_usage_makes_nothing(tree):
    work, _, _ = tree
    done, calls = run(tree, "nonsense")
    assert done.returncode == 2 and "usage" in done.stderr
    assert not (work / ".venv").exists() and calls == []


def test_readme_and_gitignore_say_where_run_installs():
    head = (ROOT / "README.md").read_text()[:4000]
    assert ".venv" in head and "rm -rf .venv" in head
    assert "externally" in head or "PEP 668" in head
    assert "QTENSOR_VENV=0" in head
    assert ".venv/" in (ROOT / ".gitignore").read_text().split()
