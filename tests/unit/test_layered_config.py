"""Several config files layered (later ones override earlier ones key by key) plus --set, resolved
as one typed config; an error names the file (or --set) that set the bad key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tests.runlib import hpclaunch

from hpclaunch.config import load_config, merge_layers
from hpclaunch.errors import ConfigError

pytestmark = pytest.mark.fast

BASE = """\
name: base
scheduler: {kind: slurm, nodes: 2, time_limit: "02:00:00", exclude: [n1, n2]}
train: {steps: 1000, lr: 1.0e-3, warmup_steps: 100}
launch: {env: {A: "1", B: "2"}}
"""
HIGHRES = """\
name: highres
scheduler: {exclude: [n3]}
model: {latent_len: 16}
train: {steps: 3000}
launch: {env: {B: "3"}}
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.spawns
def test_later_files_override_key_by_key_then_set(tmp_path: Path) -> None:
    base, exp = write(tmp_path, "base.yaml", BASE), write(tmp_path, "exp.yaml", HIGHRES)
    cfg = load_config([base, exp], ["train.lr=5e-4", "launch.env.C=4"])
    assert cfg.name == "highres"
    assert (cfg.scheduler.kind, cfg.scheduler.nodes, cfg.scheduler.time_limit) == ("slurm", 2, "02:00:00")
    assert cfg.scheduler.exclude == ["n3"]  # lists are replaced whole
    assert (cfg.train.steps, cfg.train.lr, cfg.train.warmup_steps) == (3000, 5e-4, 100)
    assert cfg.model.latent_len == 16 and cfg.model.text_len == 32  # untouched keys keep defaults
    assert cfg.launch.env == {"A": "1", "B": "3", "C": "4"}
    # The same through the CLI: `config show` prints the resolved config the run directory records.
    shown = yaml.safe_load(
        hpclaunch("config", "show", str(base), str(exp), "--set", "train.lr=5e-4", cwd=tmp_path).stdout
    )
    assert shown["name"] == "highres" and shown["train"]["steps"] == 3000 and shown["train"]["lr"] == 5e-4
    assert shown["launch"]["env"] == {"A": "1", "B": "3"}


@pytest.mark.spawns
def test_an_unknown_key_in_the_second_file_is_named_with_that_file(tmp_path: Path) -> None:
    base = write(tmp_path, "base.yaml", BASE)
    exp = write(tmp_path, "exp.yaml", HIGHRES.replace("steps: 3000", "stepz: 3000"))
    with pytest.raises(ConfigError) as err:
        load_config([base, exp])
    assert (
        err.value.where == str(exp)
        and "unknown key 'train.stepz' (did you mean train.steps?)" in err.value.message
    )
    out = hpclaunch("render", str(base), str(exp), cwd=tmp_path, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[0] == (
        f"hpclaunch: error: {exp}: unknown key 'train.stepz' (did you mean train.steps?)"
    )


def test_a_bad_value_is_named_with_the_layer_that_set_it(tmp_path: Path) -> None:
    base = write(tmp_path, "base.yaml", BASE)
    exp = write(tmp_path, "exp.yaml", "train: {steps: 50}\n")  # now warmup_steps (from base) is too long
    with pytest.raises(ConfigError, match=r"warmup_steps: 100 must be smaller than train\.steps=50") as err:
        load_config([base, exp])
    # exp.yaml made it wrong (issue 26: base.yaml was blamed alone); both are named, each with its key.
    assert err.value.where == f"{base} + {exp}"
    assert f"(train.warmup_steps from {base}, train.steps from {exp})" in err.value.message
    with pytest.raises(ConfigError) as err:
        load_config([base, exp], ["train.lr=-1"])
    assert err.value.where == "--set" and "train.lr" in err.value.message
    with pytest.raises(ConfigError) as err:
        load_config([base, write(tmp_path, "bad.yaml", "scheduler: {nodes: 0}\n")])
    assert err.value.where == str(tmp_path / "bad.yaml")


def test_a_section_replaced_by_a_scalar_belongs_to_the_later_layer() -> None:
    merged, sources = merge_layers([("a", {"train": {"lr": 1, "steps": 2}}), ("b", {"train": None})])
    assert merged == {"train": None} and sources == {"train": "b"}


# ---- issue 26: errors name their real source through layering, sweeps and flags ----------------


def test_a_cross_field_error_names_the_layer_that_changed_it_and_where_the_other_value_came_from(
    tmp_path: Path,
) -> None:
    run = write(tmp_path, "run.yaml", "train: {warmup_steps: 10}\n")
    with pytest.raises(ConfigError) as e:
        load_config(run, ["train.steps=5"])
    assert e.value.one_line() == (
        f"{run} + --set: train.warmup_steps: 10 must be smaller than train.steps=5 "
        f"(train.warmup_steps from {run}, train.steps from --set)"
    )
    # Two files: both named, in the order they were layered.
    short = write(tmp_path, "short.yaml", "train: {steps: 8}\n")
    with pytest.raises(ConfigError) as e:
        load_config([run, short])
    assert e.value.where == f"{run} + {short}" and f"(train.warmup_steps from {run}," in e.value.message


def test_the_default_warmup_scales_so_a_short_run_needs_one_override() -> None:
    assert load_config(None, ["train.steps=5"]).train.warmup_steps == 0
    assert load_config(None, ["train.steps=10"]).train.warmup_steps == 1
    assert load_config(None, ["train.steps=11"]).train.warmup_steps == 10  # as before
    assert load_config(None).train.warmup_steps == 10


def test_sweep_and_render_flags_are_named_in_their_own_errors() -> None:
    from hpclaunch.orchestrator.launch import expand_sweep

    cfg = load_config(None)
    with pytest.raises(ConfigError) as e:
        expand_sweep(cfg, ["train.lrr=1,2"])
    assert e.value.one_line().startswith("--sweep: unknown key 'train.lrr' (did you mean train.lr?)")
    with pytest.raises(ConfigError) as e:
        expand_sweep(cfg, ["train.steps=300,2"])
    assert e.value.where == "--sweep point 1 (train.steps=2)"
    with pytest.raises(ConfigError) as e:
        load_config(None, flags=[("scheduler.pbs_dialect=torque", "--pbs-dialect")])
    assert (
        e.value.one_line()
        == "--pbs-dialect: scheduler.pbs_dialect: only applies to kind: pbs (kind is local)"
    )
    with pytest.raises(ConfigError) as e:
        load_config(None, flags=[("scheduler.kind=slurmm", "--scheduler")])
    assert e.value.where == "--scheduler"


def test_render_flags_apply_before_the_config_is_validated(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 39 (13): `render tiny.yaml --scheduler slurm --set scheduler.nodes=2` was refused with
    "the local scheduler runs one node": the config was validated as local before --scheduler."""
    from hpclaunch.cli import main

    tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"
    assert main(["render", str(tiny), "--scheduler", "slurm", "--set", "scheduler.nodes=2"]) == 0
    assert "#SBATCH --nodes=2" in capsys.readouterr().out
    assert main(["render", str(tiny), "--set", "scheduler.nodes=2"]) == 2  # still local: one node
    assert "the local scheduler runs one node" in capsys.readouterr().err


def test_resume_with_set_blames_set_not_the_runs_config(tmp_path: Path) -> None:
    from hpclaunch.rundir import RunPaths
    from hpclaunch.rundir.readers import read_config

    paths = RunPaths(tmp_path / "r").ensure()
    paths.config.write_text(load_config(None).to_yaml())
    with pytest.raises(ConfigError) as e:
        read_config(paths, ["train.steps=5"])
    assert e.value.where == "--set" and f"(train.warmup_steps from {paths.config})" not in e.value.message


def test_every_cross_field_error_names_the_later_layer_and_the_earlier_one(tmp_path: Path) -> None:
    """The class: a value valid in its file, made wrong by a later layer, names both layers (the
    later one last), and which key each set; a key left at its default is not blamed on anyone."""
    run = write(tmp_path, "run.yaml", "train: {global_batch: 16}\nscheduler: {procs_per_node: 2}\n")
    with pytest.raises(ConfigError) as e:
        load_config(run, ["scheduler.procs_per_node=3"])
    assert e.value.where == f"{run} + --set" and "train.global_batch" in e.value.message
    assert f"train.global_batch from {run}, scheduler.procs_per_node from --set" in e.value.message
    lead = write(tmp_path, "lead.yaml", "launch: {stop_lead_s: 60}\n")
    with pytest.raises(ConfigError) as e:
        load_config(lead, ["scheduler.time_limit=30s"])
    assert e.value.where == f"{lead} + --set" and "launch.stop_lead_s" in e.value.message
    # The file holds a train section, but not train.steps: only --set set a key of the rule.
    other = write(tmp_path, "other.yaml", "train: {lr: 1.0e-3}\n")
    with pytest.raises(ConfigError) as e:
        load_config(other, ["train.warmup_steps=500"])
    assert e.value.where == "--set" and " from " not in e.value.message
