"""Fixtures for tests against the real local SLURM cluster started by `scripts/local-slurm`.

`slurm_cluster` gives the 1-node layout, `slurm_cluster_2nodes` the 2-node one (n1, n2 in their
own network namespaces, see the script's header) and `slurm_cluster_3nodes` the 3-node one (n1-n3:
two training nodes and a hot spare). Only one layout runs at a time, so:

* tests are ordered by the layout they use (1, then 2, then 3 nodes), so that a session switches
  layout as few times as it can, and the 1-node layout is restored when the session ends;
* before each test the layout it asked for is checked (one file read) and switched if another
  test or another session changed it.

The cluster is left running after the session (it starts in well under a second, and other
sessions reuse it); `scripts/local-slurm down` is for humans.

Every test under tests/cluster is marked `slurm`. Where the cluster cannot run (not root, SLURM
not installed) the tests are skipped, unless HPCLAUNCH_REQUIRE_SLURM=1 (CI): then it is an error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "local-slurm"
CLUSTER_TESTS = Path(__file__).resolve().parent
SLURM_CONF = Path("/etc/slurm/slurm.conf")
CONF_MARK = "# hpclaunch-local-slurm "
SCRIPT_CANNOT_RUN_HERE = 2  # the script's exit status for "not root / not installed"
# A job that is given back to the queue (requeue) leaves these states again.
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
    }
)
# Waiting up to this long for running jobs (of another test or session) before a layout switch
# cancels them; HPCLAUNCH_SLURM_SWITCH_WAIT overrides it.
SWITCH_WAIT_S = int(os.environ.get("HPCLAUNCH_SLURM_SWITCH_WAIT", "30"))

_KEY = re.compile(r"(?:^|\s)([A-Za-z][\w/:.]*)=")


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One `scontrol show ... -o` line to a dict; values may hold spaces and '='."""
    keys = list(_KEY.finditer(line))
    out: dict[str, str] = {}
    for m, nxt in zip(keys, [*keys[1:], None], strict=True):
        end = nxt.start() if nxt is not None else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


def installed_layout() -> dict[str, str]:
    """The marker line of the running cluster's slurm.conf: layout, dir, nodes (name:addr,...)."""
    try:
        with SLURM_CONF.open() as f:
            first = f.readline().strip()
    except OSError:
        return {}
    if not first.startswith(CONF_MARK):
        return {}
    return dict(kv.split("=", 1) for kv in first[len(CONF_MARK) :].split() if "=" in kv)


@dataclass(frozen=True)
class SlurmCluster:
    """What a test needs to know about the running cluster, plus job helpers."""

    layout: int
    nodes: list[str]
    node_addrs: dict[str, str]
    state_dir: Path
    partition: str = "debug"
    partitions: tuple[str, ...] = ("debug", "short")
    short_max_minutes: int = 5
    kill_wait_s: int = 30

    def run(self, *cmd: str, cwd: Path | str | None = None, timeout: float = 60) -> str:
        """Run a SLURM client command; returns stdout, raises with stderr on failure."""
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def sbatch(self, *args: str, cwd: Path | str | None = None) -> str:
        """`sbatch --parsable ARGS` -> job id."""
        return self.run("sbatch", "--parsable", *args, cwd=cwd).strip().split(";")[0]

    def job_info(self, job_id: str | int) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict (first record for an array).

        Finished jobs stay visible for MinJobAge (600 s). Raises KeyError for an unknown job.
        """
        proc = subprocess.run(
            ["scontrol", "show", "job", "-o", str(job_id)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        line = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
        if proc.returncode != 0 or not line.startswith("JobId="):
            raise KeyError(f"job {job_id}: {proc.stderr.strip() or proc.stdout.strip()}")
        return parse_scontrol_record(line)

    def job_state(self, job_id: str | int) -> str:
        return self.job_info(job_id)["JobState"]

    def wait_job(
        self,
        job_id: str | int,
        states: Iterable[str] = FINAL_STATES,
        timeout: float = 60.0,
        poll: float = 0.1,
    ) -> str:
        """Wait until the job is in one of `states` or in a final state; return that state.

        So `wait_job(j, {"RUNNING"})` returns "FAILED" at once if the job failed before it ran.
        Raises TimeoutError (with the job record) after `timeout` seconds.
        """
        wanted = frozenset(states)
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job_id)
            if state in wanted or state in FINAL_STATES:
                return state
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"job {job_id} still {state} after {timeout:.0f}s "
                    f"(wanted {sorted(wanted)}): {self.job_info(job_id)}"
                )
            time.sleep(poll)

    def cancel(self, *job_ids: str | int) -> None:
        """scancel, ignoring jobs that are already gone."""
        if job_ids:
            subprocess.run(["scancel", *map(str, job_ids)], capture_output=True, check=False)


class _Layouts:
    """Brings up the layout a test asks for; remembers whether this session changed it."""

    def __init__(self) -> None:
        self.switched = False

    def ensure(self, layout: int) -> SlurmCluster:
        current = installed_layout()
        if current.get("layout") != str(layout) or not _daemons_alive(current):
            self._up(layout)
            current = installed_layout()
            if layout != 1:
                self.switched = True
        return _cluster_from(current)

    def _up(self, layout: int) -> None:
        cmd = [str(SCRIPT), "up", "--nodes", str(layout), "--wait-jobs", str(SWITCH_WAIT_S)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            _cannot_start(f"{' '.join(cmd)}: {exc}", skippable=isinstance(exc, OSError))
            return
        if proc.returncode != 0:
            _cannot_start(
                f"`scripts/local-slurm up --nodes {layout}` exited {proc.returncode}:\n"
                f"{proc.stdout}{proc.stderr}".strip(),
                skippable=proc.returncode == SCRIPT_CANNOT_RUN_HERE,
            )

    def restore_default(self) -> None:
        if self.switched and installed_layout().get("layout") != "1":
            try:
                self._up(1)
            except (Exception, pytest.skip.Exception, pytest.fail.Exception) as exc:
                warnings.warn(f"could not restore the 1-node SLURM layout: {exc}", stacklevel=1)


MARIADB_PID = Path("/run/mysqld/mariadbd.pid")  # (scripts/local-slurm's MYSQL_RUN)


def _daemons_alive(current: dict[str, str]) -> bool:
    """Cheap check of the pid files the script writes (no SLURM command)."""
    run = Path(current.get("dir", "/nonexistent")) / "run"
    names = ["slurmctld"] + [f"slurmd-{n.split(':')[0]}" for n in current.get("nodes", "").split(",")]
    # (the accounting's daemons too: a dead MariaDB left sacct without records while the rest ran)
    pidfiles = [run / f"{name}.pid" for name in [*names, "slurmdbd", "munged"]] + [MARIADB_PID]
    for pidfile in pidfiles:
        try:
            pid = pidfile.read_text().strip()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return False
    return True


def _cluster_from(current: dict[str, str]) -> SlurmCluster:
    pairs = [p.split(":", 1) for p in current["nodes"].split(",")]
    return SlurmCluster(
        layout=int(current["layout"]),
        nodes=[name for name, _ in pairs],
        node_addrs=dict((name, addr) for name, addr in pairs),
        state_dir=Path(current["dir"]),
        short_max_minutes=int(current.get("short_max_min", 5)),
        kill_wait_s=int(current.get("kill_wait", 30)),
    )


def _cannot_start(reason: str, *, skippable: bool) -> None:
    if skippable and os.environ.get("HPCLAUNCH_REQUIRE_SLURM") != "1":
        pytest.skip(f"local SLURM cluster unavailable: {reason}")
    pytest.fail(f"local SLURM cluster failed to start: {reason}", pytrace=False)


@pytest.fixture(scope="session")
def _slurm_layouts() -> Iterator[_Layouts]:
    layouts = _Layouts()
    yield layouts
    layouts.restore_default()


@pytest.fixture(scope="session")
def slurm_cluster(_slurm_layouts: _Layouts) -> SlurmCluster:
    """The 1-node cluster (node = short hostname at 127.0.0.1), partitions debug and short."""
    return _slurm_layouts.ensure(1)


@pytest.fixture(scope="session")
def slurm_cluster_2nodes(_slurm_layouts: _Layouts) -> SlurmCluster:
    """The 2-node cluster: n1 at 10.200.0.11, n2 at 10.200.0.12 (own network namespaces)."""
    return _slurm_layouts.ensure(2)


@pytest.fixture(scope="session")
def slurm_cluster_3nodes(_slurm_layouts: _Layouts) -> SlurmCluster:
    """The 3-node cluster: n1-n3 at 10.200.0.11-13 (two training nodes and a hot spare)."""
    return _slurm_layouts.ensure(3)


@pytest.fixture(scope="session")
def common_reference(
    slurm_cluster_3nodes: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Future[str]]:
    """The run of ``side_by_side.COMMON`` never interrupted, on two nodes of the 3-node cluster,
    submitted in the background by the first module that asks (its runs start beside it); its
    ``result()`` is the parameters' hash that module's runs must end with, and the later modules'."""
    from tests.cluster.side_by_side import COMMON
    from tests.runlib import TINY, final_params_sha, hpclaunch, synth_data, tiny_overrides, wait_run_done

    work = tmp_path_factory.mktemp("common-reference")

    def reference() -> str:
        data = synth_data(work / "data")
        sets = tiny_overrides(work, data, "reference", *COMMON, "testing.step_sleep_s=0")
        hpclaunch("submit", str(TINY), *sets, "--no-preflight", cwd=work)
        s = wait_run_done(work / "runs" / "reference", work, timeout=900)
        assert s["state"] == "finished", json.dumps(s, indent=1)[-2000:]
        return final_params_sha(work / "runs" / "reference")

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="common-reference") as pool:
        yield pool.submit(reference)


LAYOUT_FIXTURES = {"slurm_cluster": 1, "slurm_cluster_2nodes": 2, "slurm_cluster_3nodes": 3}


def _layout_of(item: pytest.Item) -> int:
    used = [n for name, n in LAYOUT_FIXTURES.items() if name in getattr(item, "fixturenames", ())]
    return used[0] if used else 0


@pytest.fixture(autouse=True)
def _slurm_layout_guard(request: pytest.FixtureRequest) -> None:
    """Session fixtures are set up once; re-check the layout before every test that uses one."""
    used = [n for name, n in LAYOUT_FIXTURES.items() if name in request.fixturenames]
    if len(used) > 1:
        pytest.fail("a test can use one SLURM layout fixture only", pytrace=False)
    if used:
        request.getfixturevalue("_slurm_layouts").ensure(used[0])


def _in_cluster_dir(item: pytest.Item) -> bool:
    return CLUSTER_TESTS in Path(str(item.path)).resolve().parents


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # tryfirst: the marker must be on the items before `-m slurm` selects on it.
    for item in items:
        if _in_cluster_dir(item):
            item.add_marker(pytest.mark.slurm)
    # Stable sort by layout (tests that use none first): a session switches layout at most twice.
    items.sort(key=_layout_of)
