"""The probe's JSON has one declaration (``hpclaunch.probe_shapes``) for both sides of the process
boundary: the trainer's scripts (``probe_main.py``, ``step_probe.py``) write it, preflight
(``preflight/probe.py``, which never imports the trainer) reads it. Neither side declares its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from hpclaunch import probe_shapes
from hpclaunch.preflight import probe as reader

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[2] / "src" / "hpclaunch"
SIDES = [SRC / "preflight" / "probe.py", SRC / "trainer" / "probe_main.py", SRC / "trainer" / "step_probe.py"]
SHAPES = ["TorchDevice", "TorchInfo", "PackageInfo", "ModelInfo", "ProbeAnswer", "StepMeasure", "StepRequest"]


def test_preflight_reads_the_one_declaration() -> None:
    assert reader.ProbeAnswer is probe_shapes.ProbeAnswer
    assert reader.StepMeasure is probe_shapes.StepMeasure


@pytest.mark.parametrize("path", SIDES, ids=[p.name for p in SIDES])
def test_no_side_declares_a_shape_of_its_own(path: Path) -> None:
    tree = ast.parse(path.read_text())
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    assert not own & {*SHAPES, "ProbeRequest"}, f"{path.name} declares {own & set(SHAPES)}"


@pytest.mark.spawns
def test_the_scripts_run_where_hpclaunch_is_not_importable(tmp_path: Path) -> None:
    """They name the shapes for the type checker only: copied away from the package, with
    hpclaunch hidden, both still load."""
    for script in SIDES[1:]:
        copy = tmp_path / script.name
        copy.write_text(script.read_text())
        hide = "import sys; sys.modules['hpclaunch'] = None; import runpy; "
        code = hide + f"runpy.run_path({str(copy)!r}, run_name='not_main')"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
