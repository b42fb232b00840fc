"""``hpclaunch verify-resume`` on real scripts: the DDP example on three ranks resumes exactly; the FSDP2 example (nanoGPT's batches from each rank's
random state) resumes exactly after a stop and a crash and restores equal on fewer ranks; a variant
that draws its next batch before the step boundary fails, naming the first step that differs and
the random state."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tests.runlib import ROOT, hpclaunch

pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples" / "byo"
SMALL = ["--batch", "4", "--block", "16", "--layers", "1", "--d-model", "32", "--steps", "15"]


def test_the_fsdp_example_resumes_exactly(tmp_path: Path) -> None:
    out = hpclaunch(
        "verify-resume", "--script", str(EXAMPLES / "gpt_fsdp.py"), "--json", "--", *SMALL,
        cwd=tmp_path, timeout=1200,
    )  # fmt: skip
    found = {f["scenario"]: f for f in json.loads(out.stdout)}
    assert set(found) == {"stop", "crash", "2 -> 1 ranks"}, found
    assert all(f["ok"] for f in found.values()), found
    assert "bitwise equal at every step of 15" in found["stop"]["summary"]


def test_a_batch_drawn_before_the_step_boundary_is_named(tmp_path: Path) -> None:
    shutil.copy(EXAMPLES / "gpt.py", tmp_path / "gpt.py")
    text = (EXAMPLES / "gpt_fsdp.py").read_text()
    loop = "for step in run.steps(total=args.steps):  # hpclaunch\n"
    inside = "    x, y = get_batch()  # drawn inside the step: a resume draws it again, the same\n"
    assert loop in text and inside in text
    text = text.replace(loop, "x, y = get_batch()  # the first batch, before the loop\n" + loop)
    text = text.replace(inside, "")
    text = text.replace(
        '    meta["tokens_seen"] +=',
        '    x, y = get_batch()  # the next step\'s, drawn now\n    meta["tokens_seen"] +=',
    )
    (tmp_path / "prefetching.py").write_text(text)
    out = hpclaunch(
        "verify-resume", "--script", str(tmp_path / "prefetching.py"), "--only", "stop", "--json", "--", *SMALL,
        cwd=tmp_path, timeout=1200, check=False,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    (finding,) = json.loads(out.stdout)
    resumed = finding["step"] - 1
    assert not finding["ok"] and 1 <= resumed < 15, finding
    assert finding["what"] == "rng_after_restore.torch" and f"step {resumed + 1}" in finding["summary"], (
        finding
    )
    assert "batch drawn before the loop" in finding["hint"], finding


def test_the_ddp_example_on_three_ranks_resumes_exactly(tmp_path: Path) -> None:
    # Three ranks: the ring all-reduce's summation order follows DDP's bucket layout, which a fresh
    # process used to build differently for its first step than the uninterrupted run had rebuilt it.
    out = hpclaunch(
        "verify-resume", "--script", str(EXAMPLES / "gpt_ddp.py"), "--ranks", "3", "--only", "stop", "--json",
        "--", "--steps", "24",
        cwd=tmp_path, timeout=1200,
    )  # fmt: skip
    (finding,) = json.loads(out.stdout)
    assert finding["ok"], finding
    assert "bitwise equal at every step of 24" in finding["summary"], finding
