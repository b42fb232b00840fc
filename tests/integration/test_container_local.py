"""Issue 37 with a real container runtime (Charliecloud's ch-run) on the embedded local scheduler: an
image made on this machine (``tests/containerlib.py``), the ranks running in it, a crashed rank
restarted in place, bitwise equal to the same run outside; preflight's container check, for real,
on a good image and a missing one.

Issue 49, H1: the image's /tmp is not the node's (``ch-run --private-tmp``, and ``$TMPDIR`` set as
clusters set it per job, which ch-run binds at /tmp instead of /tmp): the ranks' heartbeats went to
a /tmp the agent never read, and after ``watchdog.launch_s`` every healthy rank was killed as a
launch hang. The submitted run here has both, and a launch window shorter than its attempts."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from tests.containerlib import IMAGE_PYTHON, charliecloud_available, charliecloud_image
from tests.runlib import (
    TINY,
    events,
    final_params_sha,
    hpclaunch,
    rank_process,
    sets,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)

pytestmark = pytest.mark.slow

STEPS = (
    "train.steps=120",
    "testing.step_sleep_s=0.2",  # (each attempt outlasts the launch window below)
    "train.log_every=1",
    "checkpoint.every_steps=30",
    "scheduler.max_failure_retries=1",
)
# The image's /tmp private and the node's $TMPDIR elsewhere (issue 49, H1); a launch window the
# attempts outlast (the first report of a rank forked warm comes in seconds).
PRIVATE_TMP = ("container.flags=[--private-tmp]", "watchdog.launch_s=10", "watchdog.poll_s=1")


@pytest.fixture(scope="module")
def image() -> Path:
    why = charliecloud_available()
    if why is not None:
        if os.environ.get("HPCLAUNCH_REQUIRE_CONTAINER") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return charliecloud_image()


def in_image(image: Path | str) -> tuple[str, ...]:
    return ("container.runtime=charliecloud", f"container.image={image}", f"container.python={IMAGE_PYTHON}")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("container-local")


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    return synth_data(work / "data")


def test_preflight_passes_the_image_and_catches_a_missing_one_in_one_line(
    image: Path, work: Path, data: Path
) -> None:
    base = tiny_overrides(work, data, "pre")
    good = hpclaunch(
        "preflight", str(TINY), *base, *sets(*in_image(image)), "--only", "container,env", "--json", cwd=work
    )
    rows = {c["name"]: c for c in json.loads(good.stdout)["checks"]}
    assert rows["container"]["status"] == "pass", rows
    assert f"{IMAGE_PYTHON} in the image starts hpclaunch" in rows["container"]["finding"]
    assert rows["env"]["status"] == "pass" and "torch" in rows["env"]["finding"]

    missing = work / "no-such-image"
    bad = hpclaunch("preflight", str(TINY), *base, *sets(*in_image(missing)), "--json", cwd=work, check=False)
    assert bad.returncode == 1
    failed = [c for c in json.loads(bad.stdout)["checks"] if c["status"] == "fail"]
    assert [(c["name"], c["finding"]) for c in failed] == [
        ("container", f"container.image {missing} does not exist here")
    ]
    # what Debian's charliecloud-runtime can use: a root filesystem tree (it ships no ch-image)
    assert "make it (a root filesystem directory: mkdir" in failed[0]["hint"]
    assert "ch-image" not in failed[0]["hint"]
    # submit runs the same checks first and submits nothing
    refused = hpclaunch(
        "submit", str(TINY), *tiny_overrides(work, data, "refused", *in_image(missing)), cwd=work, check=False
    )
    assert refused.returncode == 1 and "container.image" in refused.stderr
    assert not (work / "runs" / "refused" / "scheduler" / "local.json").exists()


def test_ranks_run_in_the_image_and_a_crash_restarts_in_place_bitwise_equal_to_outside(
    image: Path, work: Path, data: Path
) -> None:
    run = work / "runs" / "inside"
    # The reference outside first, in the foreground: run beside the submitted one on a busy
    # machine it could outlast it, and the crash below would find no rank left to kill.
    hpclaunch(
        "train", str(TINY), *tiny_overrides(work, data, "outside", *STEPS, "testing.step_sleep_s=0"), cwd=work
    )
    job_tmp = work / "job-tmp"  # the node's $TMPDIR, as a cluster sets it per job
    job_tmp.mkdir()
    node_dir = job_tmp / f"hpclaunch-{os.getuid()}"
    hpclaunch(
        "submit",
        str(TINY),
        *tiny_overrides(
            work, data, "inside", *STEPS, *in_image(image), *PRIVATE_TMP, f"launch.env.TMPDIR={job_tmp}"
        ),
        "--no-preflight",
        cwd=work,
    )

    rank = rank_process(run, 0, timeout=400)  # (CI's cores are busy: the image's start is slow)
    # the image's Python (no such path on this machine), in a mount namespace of its own
    assert rank.cmdline()[:4] == [IMAGE_PYTHON, "-u", "-m", "hpclaunch.rank.host"]
    assert not Path(IMAGE_PYTHON).exists()
    assert os.readlink(f"/proc/{rank.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    # it reports at /tmp/hpclaunch-<uid>/... in the image, which is the node's $TMPDIR/hpclaunch-<uid>,
    # read there by its agent: not in the run directory (where ranks with no node directory report)
    assert list(node_dir.glob("progress/*/*/*/rank0.progress.json")), sorted(map(str, node_dir.rglob("*")))
    assert not list(run.glob("attempts/*/rank*.progress.json"))
    wait_for(
        lambda: any(e["event"] == "checkpoint_saved" and e.get("step") == 30 for e in events(run)),
        timeout=400,  # (the ranks start inside the image; CI's cores are busy)
        poll=0.1,
        what="the checkpoint at step 30",
    )
    forkserver = rank.ppid()
    rank_process(run, 1).send_signal(signal.SIGKILL)
    wait_for(
        lambda: len({e["attempt"] for e in events(run) if e["event"] == "started"}) == 2,
        timeout=120,
        what="attempt 2",
    )
    # in place: the next attempt's ranks come from the same warm forkserver, in the image
    again = rank_process(run, 0)
    assert again.pid != rank.pid and again.ppid() == forkserver
    assert again.cmdline()[0] == IMAGE_PYTHON
    s = wait_run_done(run, work, timeout=300)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert [(a["end"], a["cause"]) for a in s["attempts"]] == [
        ("restarted in place", "crash"),
        ("finished", None),
    ]
    assert final_params_sha(run) == final_params_sha(work / "runs" / "outside")
    assert not [e for e in events(run) if e["event"] == "hang"]  # past launch_s, no hang declared
    # the node checks ran on the node (the agent's side) before both attempts, the container's too
    checks = [
        {c["name"]: c["status"] for c in e["checks"]} for e in events(run) if e["event"] == "node_preflight"
    ]
    assert len(checks) == 2 and all(c["container"] == "pass" and c["disk"] == "pass" for c in checks), checks
