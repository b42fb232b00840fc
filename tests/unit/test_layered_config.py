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
    with pytest.raises(ConfigError, match="warmup_steps: 100 must be smaller than steps=50") as err:
        load_config([base, exp])
    assert err.value.where == str(base)  # base.yaml set warmup_steps
    with pytest.raises(ConfigError) as err:
        load_config([base, exp], ["train.lr=-1"])
    assert err.value.where == "--set" and "train.lr" in err.value.message
    with pytest.raises(ConfigError) as err:
        load_config([base, write(tmp_path, "bad.yaml", "scheduler: {nodes: 0}\n")])
    assert err.value.where == str(tmp_path / "bad.yaml")


def test_a_section_replaced_by_a_scalar_belongs_to_the_later_layer() -> None:
    merged, sources = merge_layers([("a", {"train": {"lr": 1, "steps": 2}}), ("b", {"train": None})])
    assert merged == {"train": None} and sources == {"train": "b"}
