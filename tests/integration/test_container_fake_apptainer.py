"""The Apptainer path with a FAKE ``apptainer`` (the real one is not in Debian 12's packages): a
script that reads the command line the agent gives it as Apptainer would (``exec [--nv] [--bind
SRC:DST] --pwd DIR IMAGE CMD...``), takes APPTAINERENV_<name> as Apptainer does, and runs CMD as its
child, as Apptainer's starter stays between the caller and the container. No image is entered: what
this proves is the agent's side (the line, the environment by name, a runtime process standing
between the agent and the rank host: its replies, its in-place restart, its exit), not Apptainer."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
from pathlib import Path

import pytest
from tests.runlib import (
    TINY,
    events,
    hpclaunch,
    rank_process,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)

pytestmark = pytest.mark.slow

FAKE = """\
#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
assert args.pop(0) == "exec", sys.argv
seen = {{"argv": sys.argv[1:], "binds": [], "nv": False}}
while args[0].startswith("-"):
    flag = args.pop(0)
    if flag == "--bind":
        src, dst = args.pop(0).split(":")[:2]
        # (the node directory is mounted at /tmp/<its name>; every other path at its own)
        assert os.path.isdir(src) and dst in (src, "/tmp/" + os.path.basename(src)), (src, dst)
        node_dir = dst == "/tmp/" + os.path.basename(src) and os.path.basename(src).startswith("hpclaunch-")
        seen["binds"].append("node dir " + os.path.basename(src) if node_dir else src)
    elif flag == "--pwd":
        os.chdir(args.pop(0))
    elif flag == "--nv":
        seen["nv"] = True
image = args.pop(0)
assert os.path.isfile(image), image
env = dict(os.environ)
for name, value in os.environ.items():  # Apptainer: APPTAINERENV_X becomes X inside
    if name.startswith("APPTAINERENV_"):
        env[name[len("APPTAINERENV_"):]] = value
        seen.setdefault("passed", []).append(name[len("APPTAINERENV_"):])
with open({record!r} + f".{{os.getpid()}}.json", "w") as f:
    json.dump(seen, f)
sys.exit(subprocess.call(args, env=env))  # a process of its own between the caller and CMD
"""


def test_apptainer_through_a_fake_apptainer_not_the_real_one(tmp_path: Path) -> None:
    data = synth_data(tmp_path / "data", samples=256)
    record = tmp_path / "apptainer-record"
    fake = tmp_path / "apptainer"
    fake.write_text(FAKE.format(python=sys.executable, record=str(record)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    image = tmp_path / "mmdit.sif"
    image.write_bytes(b"")
    run = tmp_path / "runs" / "fake"
    overrides = tiny_overrides(
        tmp_path,
        data,
        "fake",
        "train.steps=60",
        "testing.step_sleep_s=0.05",
        "checkpoint.every_steps=20",
        "train.log_every=1",
        "launch.env={MY_SETTING: x1}",
        "container.runtime=apptainer",
        f"container.image={image}",
        f"container.command={fake}",
        f"container.python={sys.executable}",
    )
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=tmp_path)
    rank = rank_process(run, 0)
    # agent -> the fake apptainer -> the rank host (launcher) -> its forkserver -> the rank
    host = rank.parent().parent()
    assert host.cmdline()[-3:] == ["-u", "-m", "hpclaunch.rank.host"]
    assert host.parent().cmdline()[1:3] == [str(fake), "exec"]
    wait_for(
        lambda: any(e["event"] == "checkpoint_saved" and e.get("step") == 20 for e in events(run)),
        timeout=180,
        poll=0.1,
        what="the checkpoint at step 20",
    )
    rank.send_signal(signal.SIGKILL)
    s = wait_run_done(run, tmp_path, timeout=300)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert [(a["end"], a["cause"]) for a in s["attempts"]] == [
        ("restarted in place", "crash"),
        ("finished", None),
    ]
    records = [json.loads(p.read_text()) for p in tmp_path.glob("apptainer-record.*.json")]
    assert len(records) == 1  # one rank host for the allocation, kept across the restart in place
    seen = records[0]
    # the run, the data, and the node directory the ranks share with their agent (issue 49)
    node_dir = f"node dir hpclaunch-{os.getuid()}"
    assert set(seen["binds"]) == {str(run), str(data / "tokens"), str(data / "latents"), node_dir}
    assert not seen["nv"]  # CPU ranks: no --nv
    assert {"MY_SETTING", "OMP_NUM_THREADS", "HPCLAUNCH_RUN_DIR"} <= set(seen["passed"])
    assert "x1" not in " ".join(seen["argv"])  # values never on the command line
