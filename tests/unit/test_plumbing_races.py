"""Issue 25: the small races of the plumbing at scale (one test or more per finding): the NFS-safe
exclusive create, the lock heartbeat as a compare-and-swap, the relay before any scheduler query."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpclaunch import fsutil

# ---- 4. create_exclusive: EEXIST for our own, retransmitted LINK ------------------------------------


def test_create_exclusive_counts_a_retransmitted_link_that_says_eexist_as_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An NFS client whose LINK reply was lost sends it again; the server answers the retry EEXIST,
    # though the first call made the link. Before: "someone else published", and a decision written
    # that way was read back as another's and never carried out.
    real_link = os.link

    def retransmitted(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
        real_link(src, dst)
        raise FileExistsError(17, "File exists (the retransmitted LINK)")

    monkeypatch.setattr(fsutil.os, "link", retransmitted)
    target = tmp_path / "decision.json"
    assert fsutil.create_exclusive(target, "mine")
    assert target.read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["decision.json"]  # the temporary name is gone


def test_create_exclusive_still_loses_to_a_file_that_was_there(tmp_path: Path) -> None:
    target = tmp_path / "decision.json"
    target.write_text("theirs")
    assert not fsutil.create_exclusive(target, "mine")
    assert target.read_text() == "theirs"
