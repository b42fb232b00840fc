"""The parts of "bring your own trainer" that need no process: a script's config, the CLI's split
at ``--``, what attach saves for its objects, a DataLoader's position across a resume, the random
states, and verify-resume's comparisons."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hpclaunch.cli import common
from hpclaunch.cli import main as cli
from hpclaunch.config import load_config
from hpclaunch.errors import ConfigError, UserInputError
from hpclaunch.orchestrator.verify_resume import compare_bitwise, compare_restore
from hpclaunch.rank.data_position import FollowedLoader, data_position
from hpclaunch.rank.objects import Attached
from hpclaunch.rank.rng import restore_rng_state, rng_digest, rng_state

pytestmark = pytest.mark.fast


# ---- config and command line ------------------------------------------------------------------


def test_a_scripts_run_refuses_the_builtin_trainers_keys_naming_the_first() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["script.path=train.py", "train.steps=10"])
    assert "train.steps" in e.value.one_line() and "built-in MMDiT trainer" in e.value.one_line()
    with pytest.raises(ConfigError, match=r"script\.args"):
        load_config(None, ["script.args=[--lr, '3']"])  # arguments for a script that is not there


def test_a_scripts_config_keeps_its_arguments_as_text_and_leaves_out_the_builtin_sections(
    tmp_path: Path,
) -> None:
    cfg = load_config(
        None, ["script.path=train.py", "script.args=[--steps, 100, --fast, true]"], base=tmp_path
    )
    assert cfg.is_script and cfg.script.args == ["--steps", "100", "--fast", "true"]
    assert cfg.script.path == str(tmp_path / "train.py") and cfg.script.workdir == str(tmp_path)
    written = cfg.to_dict()
    assert not {"model", "data", "train"} & set(written) and written["script"]["args"][1] == "100"
    # what the run directory keeps reads back (the built-in sections are not there to refuse)
    from hpclaunch.config import validate_config

    assert validate_config(written).script == cfg.script


def test_everything_after_a_double_dash_is_the_scripts() -> None:
    assert common.take_script_args(["train", "--script", "x.py", "--", "--set", "a=1", "--"]) == [
        "train",
        "--script",
        "x.py",
    ]
    assert common._script_args == ["--set", "a=1", "--"]
    assert common.script_flags(Path("x.py"))[-1] == ('script.args=["--set", "a=1", "--"]', "--")
    assert (
        common.take_script_args(["status", "runs/x"]) == ["status", "runs/x"] and common._script_args is None
    )


def test_train_without_a_config_or_a_script_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["train"]) == 2
    err = capsys.readouterr().err
    assert "give a CONFIG file or --script SCRIPT" in err and "Traceback" not in err


def test_render_a_scripts_run_names_the_script_in_its_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    out = tmp_path / "job.sh"
    assert cli(["render", "--script", "train.py", "-o", str(out), "--", "--epochs", "3"]) == 0
    assert "hpclaunch.jobs.agent" in out.read_text()  # the agent starts it, as any run


# ---- what attach saves ------------------------------------------------------------------------


class _Loaded:
    def __init__(self, sections: set[str]) -> None:
        self.saved_sections = sections
        self.ranks_without_rank_local: list[int] = []


def test_attached_objects_round_trip_extra_keys_added_later_the_scheduler_and_the_random_states() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    meta: dict[str, Any] = {"epoch": 1}
    attached = Attached(
        model=model, optimizers=[opt], objects={"scheduler": sched, "extra": meta}, data=None, rank=0,
        device=torch.device("cpu"),
    )  # fmt: skip
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    meta["best"] = 0.5  # a key the template at restore time will not have
    random.random()
    saved = attached.state({"step": 7})
    expect_rng = rng_digest()
    after = torch.rand(1)

    torch.manual_seed(123)
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    meta2: dict[str, Any] = {"epoch": 0}
    again = Attached(
        model=model2, optimizers=[opt2], objects={"scheduler": sched2, "extra": meta2}, data=None, rank=0,
        device=torch.device("cpu"),
    )  # fmt: skip
    counters = again.take(saved, _Loaded(set(saved)))
    assert counters == {"step": 7} and meta2 == {"epoch": 1, "best": 0.5}
    assert sched2.state_dict() == sched.state_dict()
    assert torch.equal(model2.weight, model.weight)
    assert rng_digest() == expect_rng and torch.equal(torch.rand(1), after)


def test_attaching_what_cannot_be_saved_is_one_line() -> None:
    with pytest.raises(UserInputError, match="no state_dict"):
        Attached(
            model=None, optimizers=[], objects={"x": object()}, data=None, rank=0, device=torch.device("cpu")
        )
    with pytest.raises(UserInputError, match="needs model="):
        opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1)
        Attached(model=None, optimizers=[opt], objects={}, data=None, rank=0, device=torch.device("cpu"))
    with pytest.raises(UserInputError, match="plain values"):  # at attach, not at the first save
        meta = {"t": torch.ones(1)}
        Attached(model=None, optimizers=[], objects={"extra": meta}, data=None, rank=0,
                 device=torch.device("cpu"))  # fmt: skip


def test_an_optimizer_of_another_model_is_refused_at_attach_and_one_model_of_both_saves() -> None:
    """attach(model=G, disc=D, optimizer=[opt_g, opt_d]) trained its steps, then failed at the first
    save inside torch's state-dict helper (KeyError: 0); now refused at attach, the fix named."""
    gen, disc = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=0.1), torch.optim.Adam(disc.parameters(), lr=0.1)
    cpu = torch.device("cpu")
    with pytest.raises(
        UserInputError, match="optimizer 1 of the list steps parameters that are not model="
    ) as e:
        Attached(model=gen, optimizers=[opt_g, opt_d], objects={"disc": disc}, data=None, rank=0, device=cpu)
    assert "nn.ModuleDict" in str(e.value)  # (in the message: a traceback in a script shows no hint)
    both = Attached(
        model=torch.nn.ModuleDict({"gen": gen, "disc": disc}),
        optimizers=[opt_g, opt_d],
        objects={},
        data=None,
        rank=0,
        device=cpu,
    )
    for opt, module in ((opt_g, gen), (opt_d, disc)):
        module(torch.ones(1, 2)).sum().backward()
        opt.step()
    state = both.state({"step": 1})
    assert {"gen.weight", "disc.weight"} <= set(state["model"]) and state["optim"]["state"]


def test_numpys_random_state_round_trips_with_its_position() -> None:
    np.random.seed(5)
    np.random.standard_normal()  # a cached Gaussian and a position inside the key
    saved = rng_state()
    want = (np.random.random(3).tolist(), np.random.standard_normal())
    np.random.seed(99)
    restore_rng_state(saved)
    assert (np.random.random(3).tolist(), np.random.standard_normal()) == want


# ---- a DataLoader's position ------------------------------------------------------------------


def _loader(sampler_seed: int | None = None) -> DataLoader[Any]:
    data = TensorDataset(torch.arange(40).float())
    return DataLoader(data, batch_size=4, shuffle=True, num_workers=0)  # a RandomSampler, no generator


def test_a_resumed_loader_continues_at_the_batch_after_the_last_one_handed_over() -> None:
    torch.manual_seed(0)
    loader = _loader()
    followed = data_position(loader)
    assert isinstance(followed, FollowedLoader)
    batches = followed.batches()
    for _ in range(13):  # one epoch is 10 batches: the second epoch, 3 in
        next(batches)
    saved = followed.state_dict()
    rng = rng_state()
    want = [next(batches)[0].tolist() for _ in range(12)]  # across the next epoch boundary too

    torch.manual_seed(1)  # a new process: another random state, a new loader
    again = data_position(_loader())
    again.load_state_dict(saved)
    restore_rng_state(rng)
    batches = again.batches()
    assert [next(batches)[0].tolist() for _ in range(12)] == want


def test_two_stops_in_one_epoch_resume_at_the_same_batches_as_no_stop() -> None:
    """Saved again after a resume and before its epoch ended, the position must still be the
    epoch's (the random state at its start): it was the new loader's, and the second resume drew
    another order."""
    torch.manual_seed(0)
    followed = data_position(_loader())
    batches = followed.batches()
    for _ in range(3):
        next(batches)
    want = [next(batches)[0].tolist() for _ in range(9)]  # the rest of epoch 1, and 2 of epoch 2

    torch.manual_seed(0)
    first = data_position(_loader())
    batches = first.batches()
    for _ in range(2):
        next(batches)
    saved, rng = first.state_dict(), rng_state()  # the first stop, after batch 2
    torch.manual_seed(1)
    second = data_position(_loader())
    second.load_state_dict(saved)
    restore_rng_state(rng)
    batches = second.batches()
    got = [next(batches)[0].tolist()]  # batch 3
    saved, rng = second.state_dict(), rng_state()  # the second stop, in the same epoch
    torch.manual_seed(2)
    third = data_position(_loader())
    third.load_state_dict(saved)
    restore_rng_state(rng)
    batches = third.batches()
    got += [next(batches)[0].tolist() for _ in range(9)]
    assert got[1:] == want


def test_a_sampler_passed_as_data_is_followed_through_the_loader_that_iterates_it() -> None:
    from torch.utils.data import DistributedSampler

    data = TensorDataset(torch.arange(30).float())
    sampler = DistributedSampler(data, num_replicas=2, rank=1, seed=3)
    followed = data_position(sampler)
    loader = DataLoader(data, batch_size=3, sampler=sampler)
    sampler.set_epoch(2)
    it = iter(loader)
    next(it)
    next(it)
    saved = followed.state_dict()
    want = [b[0].tolist() for b in it]
    assert saved["delivered"] == 2 and saved["epoch"] == 2

    sampler2 = DistributedSampler(data, num_replicas=2, rank=1, seed=3)
    again = data_position(sampler2)
    again.load_state_dict(saved)
    loader2 = DataLoader(data, batch_size=3, sampler=sampler2)
    sampler2.set_epoch(0)  # a script that forgot to keep its epoch: the saved one is used
    assert [b[0].tolist() for b in loader2] == want


# ---- verify-resume's comparisons ---------------------------------------------------------------


def _trace(
    n: int,
    *,
    rng: str = "r",
    obj: str = "m",
    unseeded: str = "p",
    change: dict[int, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    change = change or {}
    out: list[dict[str, Any]] = [
        {
            "kind": "begin",
            "step": 0,
            "rng": {"torch": f"{rng}0", "python": unseeded},
            "objects": {"model": f"{obj}0"},
        }
    ]
    for s in range(1, n + 1):
        rec: dict[str, Any] = {
            "kind": "step", "step": s, "rng_begin": {"torch": f"{rng}{s - 1}", "python": unseeded},
            "rng_end": {"torch": f"{rng}{s}", "python": unseeded}, "objects": {"model": f"{obj}{s}"},
            "logged": {"loss": float(s)}, "world_size": 2,
        }  # fmt: skip
        for key, value in change.get(s, {}).items():
            rec[key] = value
        out.append(rec)
    return out


def test_verify_names_the_first_difference_and_ignores_a_generator_the_script_never_seeds() -> None:
    ref = {0: _trace(6), 1: _trace(6)}
    same = {0: _trace(6, unseeded="other"), 1: _trace(6, unseeded="other")}
    assert compare_bitwise("stop", ref, same, 6).ok
    bad = {0: _trace(6, change={4: {"rng_begin": {"torch": "x", "python": "p"}}}), 1: _trace(6)}
    found = compare_bitwise("stop", ref, bad, 6)
    assert (
        not found.ok
        and (found.step, found.rank, found.what) == (4, 0, "rng_begin.torch")
        and "prefetched" in (found.hint or "")
    )
    kept_out = {0: _trace(6, change={3: {"logged": {"loss": 9.0}}}), 1: _trace(6)}
    found = compare_bitwise("stop", ref, kept_out, 6)
    assert (found.step, found.what) == (3, "logged.loss") and "outside attach()" in (found.hint or "")
    lost = {0: [r for r in _trace(6) if r["step"] != 5], 1: _trace(6)}
    assert compare_bitwise("crash", ref, lost, 6).what == "missing"


def test_verify_on_fewer_ranks_compares_the_restored_parameters() -> None:
    records = [
        {"kind": "begin", "step": 0, "params": "a", "world_size": 2},
        {"kind": "end", "step": 2, "cause": "user", "params": "p2", "world_size": 2},
        {"kind": "begin", "step": 2, "params": "p2", "world_size": 1},
        *({"kind": "step", "step": s, "world_size": 1} for s in (3, 4)),
    ]
    assert compare_restore("2 -> 1", {0: records}, 4).ok
    records[2] = {**records[2], "params": "other"}
    assert not compare_restore("2 -> 1", {0: records}, 4).ok


@pytest.mark.spawns
@pytest.mark.parametrize("persistent", [False, True])
def test_a_resumed_loader_with_workers_continues_at_the_next_batch(persistent: bool) -> None:
    """Workers read ahead (the loader primes them when it starts): what counts is what was handed
    over. Persistent workers keep the skipping sampler for later epochs: they must not skip again."""

    def loader() -> DataLoader[Any]:
        data = TensorDataset(torch.arange(40).float())
        return DataLoader(data, batch_size=4, shuffle=True, num_workers=2, persistent_workers=persistent)

    torch.manual_seed(0)
    followed = data_position(loader())
    batches = followed.batches()
    for _ in range(7):
        next(batches)
    saved, rng = followed.state_dict(), rng_state()
    want = [next(batches)[0].tolist() for _ in range(15)]
    del batches

    torch.manual_seed(1)
    again = data_position(loader())
    again.load_state_dict(saved)
    restore_rng_state(rng)
    batches = again.batches()
    assert [next(batches)[0].tolist() for _ in range(15)] == want


KEEPS_WORKERS = (
    "import torch\n"
    "from torch.utils.data import DataLoader, TensorDataset\n"
    "from hpclaunch.rank.data_position import data_position\n"
    "def main():\n"
    "    loader = DataLoader(TensorDataset(torch.arange(40).float()), batch_size=4, num_workers=2,\n"
    "                        persistent_workers=True)\n"
    "    global batches\n"
    "    batches = data_position(loader).batches()\n"
    "    print(next(batches)[0].tolist(), flush=True)\n"
)
# As the rank host runs a rank: a forked multiprocessing child, which ends through multiprocessing's
# exit function and os._exit (no atexit), its iterator still alive (a failure's traceback holds it).
IN_A_FORKED_CHILD = (
    "if __name__ == '__main__':\n"
    "    import multiprocessing, sys\n"
    "    child = multiprocessing.get_context('fork').Process(target=main)\n"
    "    child.start()\n"
    "    child.join()\n"
    "    sys.exit(child.exitcode)\n"
)


# An iterator whose shutdown already ran without ending its workers (torch's join timed out and its
# SIGTERM was ignored): nothing would tell them to end any more.
LEFT_RUNNING = (
    "from hpclaunch.rank.data_position import _install\n"
    "def main():\n"
    "    _install()\n"
    "    global it\n"
    "    it = iter(DataLoader(TensorDataset(torch.arange(40).float()), batch_size=4, num_workers=2))\n"
    "    print(next(it)[0].tolist(), flush=True)\n"
    "    it._shutdown = True\n"
)


@pytest.mark.spawns
@pytest.mark.parametrize("where", ["main", "forked child", "left running"])
def test_a_script_that_keeps_a_loaders_workers_alive_to_its_end_exits(tmp_path: Path, where: str) -> None:
    """Our workers ignore SIGTERM (a scheduler's must not kill them before the rank saves), and at
    the interpreter's exit multiprocessing terminates daemonic workers with SIGTERM: unless they are
    shut down first, the process waited for them for ever (in a forked child too: CI's SLURM chain,
    a rank that failed at step 60 waited 25 minutes)."""
    script = tmp_path / "keeps.py"
    body = KEEPS_WORKERS + LEFT_RUNNING if where == "left running" else KEEPS_WORKERS
    script.write_text(body + (IN_A_FORKED_CHILD if where == "forked child" else "main()\n"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "[0.0, 1.0, 2.0, 3.0]" in done.stdout, done.stderr[-2000:]


def test_a_sweep_over_a_scripts_arguments_separates_its_lists_by_semicolons(tmp_path: Path) -> None:
    from hpclaunch.orchestrator.launch import expand_sweep

    cfg = load_config(None, ["script.path=train.py", "name=s"], base=tmp_path)
    points = expand_sweep(cfg, ["script.args=[--lr,1e-3];[--lr,3e-4]", "checkpoint.keep_last=1,2"])
    assert [p[2].script.args for p in points] == [["--lr", "1e-3"]] * 2 + [["--lr", "3e-4"]] * 2
    assert all("/" not in name and "," not in name for name, _, _ in points)


@pytest.mark.parametrize(
    ("restored", "resumed_sleeps", "slept"),
    [(False, False, 0.25), (True, True, 0.25), (True, False, 0.0), (False, True, 0.25)],
)
def test_testing_step_sleep_skips_a_resumed_attempt_only_when_asked(
    restored: bool, resumed_sleeps: bool, slept: float
) -> None:
    """``testing.step_sleep_resumed=false``: a test's time limit stops the first attempt, and the
    resumed attempts run at full speed (bounded, however slow the machine's start-up)."""
    from hpclaunch.config import load_config
    from hpclaunch.rank.testing_knobs import step_sleep_s

    knobs = ["testing.step_sleep_s=0.25", f"testing.step_sleep_resumed={str(resumed_sleeps).lower()}"]
    assert step_sleep_s(load_config(None, knobs), resumed=restored) == slept


def test_attach_on_one_of_several_ranks_that_joined_no_process_group_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain script under procs_per_node=2: both ranks trained as rank 0 of one, writing the same
    checkpoints and metrics twice (exit 0)."""
    import hpclaunch

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(
        UserInputError, match=r"2 ranks were started \(WORLD_SIZE=2\) but this one joined no"
    ) as e:
        hpclaunch.attach(model=torch.nn.Linear(1, 1), run_dir=str(tmp_path / "run"))
    assert "init_process_group" in str(e.value)
    assert not (tmp_path / "run").exists()


DDP_BUFFERS = """
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from hpclaunch.rank.objects import Attached
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
def digest(rank):
    return Attached(model=ddp, optimizers=[], objects={}, data=None, rank=rank,
                    device=torch.device("cpu")).digests(whole=False)["objects"]["model"]
before = {r: digest(r) for r in (0, 1)}
ddp.module[1].running_mean += 1  # what a rank's own forward does to its buffers, DDP's next undoes
after = {r: digest(r) for r in (0, 1)}
print(before[0] != after[0], before[1] == after[1])
"""


@pytest.mark.spawns
def test_another_ranks_ddp_buffers_are_not_its_state_rank_0s_are(tmp_path: Path) -> None:
    """verify-resume failed DDP + BatchNorm scripts: rank 1's running statistics after a step are
    its own batch's, overwritten with rank 0's at the next forward, and its checkpoint holds rank 0's."""
    done = subprocess.run(
        [sys.executable, "-c", DDP_BUFFERS, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True"], done.stdout
