"""Fixtures for tests against the real OpenPBS started by `scripts/local-pbs`.

`pbs_server` gives the 1-node layout (the head's own mom), `pbs_server_2nodes` the 2-node one
(pbsn1, pbsn2: one pbs_mom each in its own network namespace) and `pbs_server_3nodes` the 3-node one
(pbsn1-pbsn3: two training nodes and a hot spare). Like the SLURM fixtures, tests run ordered by
layout so that a session switches layout as few times as it can; the server is left running.

Jobs run as the unprivileged user `hpclpbs` that `local-pbs up` creates: pbs_mom does not track
root's processes (see the script), so a root job would not get PBS's real kill sequence. The tests
run `hpclaunch` as that user too, in a work directory it owns, with the tests' own interpreter
(where it lives under a 0700 directory such as /root, the user gets traverse-only access through an
ACL for the session). PATH puts /opt/pbs/bin first: /usr/bin/qsub here is Slurm's
Torque emulation. The test process's own PATH is left alone (the SLURM tests use that qsub).

HPCLAUNCH_KEEP_PBS_WORK=1 keeps the session's work directory (run directories, logs) for a look
after a failure; jobs still queued or running from it are deleted when the session ends.

Every test under tests/pbs is marked `pbs`. Where the server cannot start (not root, no OpenPBS
tarball, not Linux) they are skipped with the reason, unless HPCLAUNCH_REQUIRE_PBS=1 (CI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "local-pbs"
PBS_TESTS = Path(__file__).resolve().parent
PBS_BIN = "/opt/pbs/bin"
JOB_USER = "hpclpbs"
STATE = Path("/etc/hpclaunch-local-pbs.layout")
SCRIPT_CANNOT_RUN_HERE = 2
# job_state letters PBS keeps a job in once it has ended (F: finished, with -x history).
FINAL = frozenset({"F", "X"})


def _cannot_start(reason: str, *, skippable: bool) -> None:
    if skippable and os.environ.get("HPCLAUNCH_REQUIRE_PBS") != "1":
        pytest.skip(f"local OpenPBS unavailable: {reason}")
    pytest.fail(f"local OpenPBS failed to start: {reason}", pytrace=False)


@dataclass
class PbsServer:
    """The running server, the job user's environment, and job helpers."""

    layout: int
    nodes: list[str]
    work_root: Path  # owned by the job user
    python: str  # an interpreter the job user can run, with hpclaunch and torch
    head: str = "pbshead"
    queues: tuple[str, ...] = ("workq", "short")
    kill_delay_s: int = 10  # workq's; read from the server when the fixture starts
    gpus_per_node: int = 2
    user: str = JOB_USER
    env: dict[str, str] = field(default_factory=dict)

    # ---- commands -------------------------------------------------------------------------------

    def run(
        self, *cmd: str, as_user: bool = True, cwd: Path | str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run a command (as the job user by default) with the PBS environment; never raises."""
        argv = list(cmd)
        if as_user:
            env_args = [f"{k}={v}" for k, v in self.env.items()]
            argv = ["runuser", "-u", self.user, "--", "/usr/bin/env", "-i", *env_args, *argv]
            return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
        env = {**os.environ, "PATH": self.env["PATH"]}
        return subprocess.run(
            argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )

    def check(
        self, *cmd: str, as_user: bool = True, cwd: Path | str | None = None, timeout: float = 60
    ) -> str:
        proc = self.run(*cmd, as_user=as_user, cwd=cwd, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}{proc.stdout[-2000:]}"
            )
        return proc.stdout

    def hpclaunch(
        self,
        *args: str,
        cwd: Path,
        timeout: float = 600,
        check: bool = True,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """`python -m hpclaunch ARGS` as the job user (extra `env` is passed through)."""
        extra = [f"{k}={v}" for k, v in (env or {}).items()]
        proc = self.run(
            "/usr/bin/env", *extra, self.python, "-m", "hpclaunch", *args, cwd=cwd, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"hpclaunch {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return proc

    def qsub(self, *args: str, cwd: Path) -> str:
        return self.check("qsub", *args, cwd=cwd).strip()

    # ---- job state ------------------------------------------------------------------------------

    def job(self, job_id: str) -> dict[str, Any]:
        """`qstat -x -f -F json JOB` (finished jobs included); KeyError when PBS does not know it."""
        proc = self.run("qstat", "-x", "-f", "-F", "json", job_id)
        if proc.returncode != 0:
            raise KeyError(f"job {job_id}: {proc.stderr.strip()}")
        jobs: dict[str, Any] = json.loads(proc.stdout).get("Jobs", {})
        if not jobs:
            raise KeyError(f"job {job_id}: qstat listed nothing")
        return next(iter(jobs.values()))

    def wait_job(
        self, job_id: str, states: Iterable[str] = FINAL, timeout: float = 60.0, poll: float = 0.2
    ) -> dict[str, Any]:
        """Wait until the job's state letter is in `states` or final; return its record."""
        wanted = frozenset(states) | FINAL
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info["job_state"] in wanted:
                return info
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} still {info['job_state']} after {timeout:.0f}s: {info}")
            time.sleep(poll)

    def delete_session_jobs(self) -> None:
        """qdel every job still queued or running from this session's work directory."""
        proc = self.run("qstat", "-f", "-F", "json", as_user=False)
        if proc.returncode != 0 or not proc.stdout.strip():
            return
        jobs = json.loads(proc.stdout).get("Jobs", {})
        ours = [
            jid
            for jid, attrs in jobs.items()
            if str(attrs.get("Variable_List", {}).get("PBS_O_WORKDIR", "")).startswith(str(self.work_root))
        ]
        if ours:
            self.run("qdel", "-W", "force", *ours, as_user=False)

    def qdel(self, *job_ids: str) -> None:
        if job_ids:
            self.run("qdel", *job_ids)


# ---- the interpreter the job user runs ----------------------------------------------------------


def _user_can_run(python: str, env: dict[str, str]) -> bool:
    argv = ["runuser", "-u", JOB_USER, "--", "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items())]
    probe = "import importlib.util as u, hpclaunch; assert u.find_spec('torch')"
    proc = subprocess.run(
        [*argv, python, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    return proc.returncode == 0


def _job_python(env: dict[str, str], granted: list[Path]) -> str:
    """sys.executable, which the job user must be able to run: the same interpreter as the tests,
    so that what a job writes (pickles in checkpoints) is what this Python reads. A venv made by
    pyenv under /root (0700), as in CI, is out of that user's reach: it gets traverse-only (x)
    access to each such directory through an ACL (`granted`, taken back when the session ends)."""
    if _user_can_run(sys.executable, env):
        return sys.executable
    if shutil.which("setfacl") is None:
        _cannot_start(
            f"{JOB_USER} cannot run {sys.executable} and setfacl is missing (apt-get install acl)",
            skippable=True,
        )
    needed = [Path(os.path.realpath(sys.executable)), Path(sys.prefix), REPO]
    for target in needed:
        for d in reversed(target.parents):
            if d in granted:
                continue
            probe = subprocess.run(["runuser", "-u", JOB_USER, "--", "test", "-x", str(d)], check=False)
            if probe.returncode != 0:
                subprocess.run(["setfacl", "-m", f"u:{JOB_USER}:x", str(d)], check=True)
                granted.append(d)
    if not _user_can_run(sys.executable, env):
        _cannot_start(
            f"the job user {JOB_USER} cannot import hpclaunch and torch with {sys.executable}", skippable=True
        )
    return sys.executable


# ---- layouts ------------------------------------------------------------------------------------


class _Layouts:
    def __init__(self) -> None:
        self.switched_to_2 = False
        self.server: PbsServer | None = None
        self.granted: list[Path] = []  # directories the job user was given traverse access to

    def ensure(self, layout: int) -> PbsServer:
        current = STATE.read_text().split()[0] if STATE.exists() else ""
        if current != str(layout):
            self._up(layout)
            self.switched_to_2 = self.switched_to_2 or layout != 1
        elif self.server is None:
            self._up(layout)  # a no-op when it is running; checks the daemons and the script's version
        if self.server is None:
            self.server = self._make_server(layout)
        self.server.layout = layout
        self.server.nodes = ["pbshead"] if layout == 1 else [f"pbsn{i}" for i in range(1, layout + 1)]
        return self.server

    def _up(self, layout: int) -> None:
        if sys.platform != "linux" or os.geteuid() != 0:
            _cannot_start("needs root on Linux (scripts/local-pbs up)", skippable=True)
        for step in (["install"], ["up", "--nodes", str(layout)]):
            try:
                proc = subprocess.run(
                    [str(SCRIPT), *step], capture_output=True, text=True, timeout=300, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                _cannot_start(
                    f"scripts/local-pbs {' '.join(step)}: {exc}", skippable=isinstance(exc, OSError)
                )
                return
            if proc.returncode != 0:
                _cannot_start(
                    f"`scripts/local-pbs {' '.join(step)}` exited {proc.returncode}:\n"
                    f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}".strip(),
                    skippable=proc.returncode == SCRIPT_CANNOT_RUN_HERE,
                )

    def _make_server(self, layout: int) -> PbsServer:
        pw = subprocess.run(["id", "-u", JOB_USER], capture_output=True, text=True, check=False)
        if pw.returncode != 0:
            _cannot_start(f"no job user {JOB_USER}", skippable=False)
        uid = int(pw.stdout)
        home = f"/home/{JOB_USER}"
        env = {
            "PATH": f"{PBS_BIN}:/usr/local/bin:/usr/bin:/bin",
            "HOME": home,
            "LANG": "C.UTF-8",
            "USER": JOB_USER,
        }
        work_root = Path(tempfile.mkdtemp(prefix="hpclaunch-pbs-tests-"))
        work_root.chmod(0o755)
        os.chown(work_root, uid, uid)
        server = PbsServer(
            layout=layout, nodes=[], work_root=work_root, python=_job_python(env, self.granted), env=env
        )
        queues = json.loads(server.check("qstat", "-Q", "-f", "-F", "json"))["Queue"]
        server.kill_delay_s = int(queues["workq"]["kill_delay"])
        return server

    def close(self) -> None:
        if self.switched_to_2 and STATE.exists() and STATE.read_text().split()[0] != "1":
            try:
                self._up(1)
            except (Exception, pytest.skip.Exception, pytest.fail.Exception) as exc:
                warnings.warn(f"could not restore the 1-node PBS layout: {exc}", stacklevel=1)
        if self.server is not None:
            self.server.delete_session_jobs()
            for d in self.granted:
                subprocess.run(["setfacl", "-x", f"u:{JOB_USER}", str(d)], check=False)
            if os.environ.get("HPCLAUNCH_KEEP_PBS_WORK") == "1":
                print(f"\nPBS test work kept in {self.server.work_root}")
            else:
                shutil.rmtree(self.server.work_root, ignore_errors=True)


@pytest.fixture(scope="session")
def _pbs_layouts() -> Iterator[_Layouts]:
    layouts = _Layouts()
    yield layouts
    layouts.close()


@pytest.fixture(scope="session")
def pbs_server(_pbs_layouts: _Layouts) -> PbsServer:
    """The 1-node layout: the head `pbshead` (10.201.0.1) runs the jobs; queues workq and short."""
    return _pbs_layouts.ensure(1)


@pytest.fixture(scope="session")
def pbs_server_2nodes(_pbs_layouts: _Layouts) -> PbsServer:
    """The 2-node layout: pbsn1 (10.201.1.11) and pbsn2 (10.201.1.12); the head is offline."""
    return _pbs_layouts.ensure(2)


@pytest.fixture(scope="session")
def pbs_server_3nodes(_pbs_layouts: _Layouts) -> PbsServer:
    """The 3-node layout: pbsn1-pbsn3 (10.201.1.11-13): two training nodes and a hot spare."""
    return _pbs_layouts.ensure(3)


PBS_LAYOUT_FIXTURES = {"pbs_server": 1, "pbs_server_2nodes": 2, "pbs_server_3nodes": 3}


def pbs_layout_of(item: pytest.Item) -> int:
    used = [n for name, n in PBS_LAYOUT_FIXTURES.items() if name in getattr(item, "fixturenames", ())]
    return used[0] if used else 0


@pytest.fixture(autouse=True)
def _pbs_layout_guard(request: pytest.FixtureRequest) -> None:
    used = [n for name, n in PBS_LAYOUT_FIXTURES.items() if name in request.fixturenames]
    if len(used) > 1:
        pytest.fail("a test can use one PBS layout fixture only", pytrace=False)
    if used:
        request.getfixturevalue("_pbs_layouts").ensure(used[0])


def user_dir(server: PbsServer, name: str) -> Path:
    """A fresh directory the job user owns, under the session's work root."""
    path = server.work_root / name
    path.mkdir(parents=True, exist_ok=True)
    uid = int(subprocess.run(["id", "-u", server.user], capture_output=True, text=True, check=True).stdout)
    os.chown(path, uid, uid)
    return path


def _in_pbs_dir(item: pytest.Item) -> bool:
    return PBS_TESTS in Path(str(item.path)).resolve().parents


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _in_pbs_dir(item):
            item.add_marker(pytest.mark.pbs)
    # PBS tests by layout (1, 2, then 3 nodes): a session switches the layout as few times as it can.
    items.sort(key=lambda it: pbs_layout_of(it) if _in_pbs_dir(it) else 0)
