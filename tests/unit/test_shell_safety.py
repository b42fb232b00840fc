"""Values with quotes, $(...), backticks, ; and newlines either reach the job intact, quoted,
or are refused with a clear message. The rendered scripts are executed for real with stubbed
launchers (srun, the job's python), and nothing injected may run."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from hpclaunch.config import load_config
from hpclaunch.errors import ConfigError, UserInputError
from hpclaunch.orchestrator.launch import prepare

NASTY = {
    "QUOTE": 'it\'s "quoted"',
    "SUBST": "$(touch {mark})",
    "BACKTICK": "`touch {mark}`",
    "SEMI": "a; touch {mark}; b",
    "NEWLINE": "one\ntouch {mark}\ntwo",
    "BREAKOUT": "x'; touch {mark}; echo '",
    "DOLLAR": "$HOME $${{PATH}} \\$",
}


def _stub(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture()
def stubs(tmp_path: Path) -> tuple[Path, Path, Path]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    dump = tmp_path / "env.json"
    dumper = f"exec python3 -c 'import json,os,sys; json.dump(dict(os.environ), open(sys.argv[1], \"w\"))' {dump}\n"
    _stub(bindir / "srun", dumper)  # SLURM: the batch shell's exports reach srun
    _stub(bindir / "mpiexec", dumper)
    python = _stub(bindir / "job-python", dumper)  # local / single-node PBS: the agent command
    return bindir, python, dump


@pytest.mark.parametrize("kind", ["slurm", "pbs", "local"])
def test_nasty_env_values_arrive_intact_and_run_nothing(
    tmp_path: Path, stubs: tuple[Path, Path, Path], kind: str
) -> None:
    bindir, python, dump = stubs
    mark = tmp_path / "pwned"
    env_values = {k: v.format(mark=mark) for k, v in NASTY.items()}
    cfg = load_config(
        None,
        [f"scheduler.kind={kind}", f"run_dir={tmp_path / 'run'}", f"launch.python={python}", "name=safe"],
        base=tmp_path,
    )
    cfg = cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"env": env_values})})
    script = tmp_path / "job.sh"
    script.write_text(prepare(cfg).rendered.text)
    (tmp_path / "run").mkdir()
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert not mark.exists(), "an injected command ran"
    seen = json.loads(dump.read_text())
    for name, value in env_values.items():
        assert seen[name] == value


def test_weird_run_dir_is_refused_for_directives_but_quoted_for_local(
    tmp_path: Path, stubs: tuple[Path, Path, Path]
) -> None:
    bindir, python, dump = stubs
    mark = tmp_path / "pwned"
    weird = tmp_path / f"a'; touch {mark}; echo 'b $(x)"
    for kind in ("slurm", "pbs"):
        cfg = load_config(None, [f"scheduler.kind={kind}", f"run_dir={weird}"], base=tmp_path)
        with pytest.raises(UserInputError, match="cannot be written into a #SBATCH/#PBS line"):
            prepare(cfg)
    cfg = load_config(None, [f"run_dir={weird}", f"launch.python={python}"], base=tmp_path)
    script = tmp_path / "job.sh"
    script.write_text(prepare(cfg).rendered.text)
    weird.mkdir(parents=True)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert not mark.exists()
    assert json.loads(dump.read_text())["HPCLAUNCH_RUN_DIR"] == str(weird)


@pytest.mark.parametrize(
    "override",
    [
        "name=a'; echo foo",
        "name=a\n0",
        "scheduler.partition=$(reboot)",
        "scheduler.account=`id`",
        "scheduler.exclude=[n1;reboot]",
    ],
)
def test_values_that_cannot_be_quoted_are_refused(override: str) -> None:
    with pytest.raises(ConfigError):
        load_config(None, ["scheduler.kind=slurm", override])


def test_extra_directive_must_be_a_directive() -> None:
    cfg = load_config(None, ["scheduler.kind=slurm", "scheduler.extra_directives=['echo hi']"])
    with pytest.raises(UserInputError, match="does not start with '#SBATCH '"):
        prepare(cfg)
