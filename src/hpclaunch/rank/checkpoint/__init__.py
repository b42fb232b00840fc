"""Checkpoints of a training run: writing, publishing, validating, choosing, loading, pruning.

This package owns ``RUN/checkpoints/``: ``rundir.checkpoint_manifest`` (names, manifest, verification,
scanning, retention rules; torch-free, the login side reads it too), ``directory`` (rank 0's view: valid, corrupt, what to load, what to
prune; torch-free), ``safe_load`` (loading without arbitrary unpickling), ``reader`` (loading one
checkpoint, also read-only for ``hpclaunch sample``), ``save_errors`` (failures in the user's words), ``writing`` (one save's write, digests, manifest and publish, wherever the writer runs),
``staging`` + ``channel`` + ``writer_protocol`` + ``writer_process`` + ``writer_main`` (the writer
process of each rank, fed through shared memory), ``background`` (the process and thread writers
behind one interface), ``priority`` (the writers' CPU priority),
``save_interval`` (when to save: every N steps or minutes, or Young/Daly), ``save_decision`` (rank 0's
verdict on a save), ``save_report`` (a published save's log line and ledger event), ``loading``
(resume: choose, verify a share on every rank, load), ``group`` (the checkpointer's own gloo group)
and ``checkpointer`` (collective saves and loads). Data is written by
torch.distributed.checkpoint (DCP), so DDP and FSDP share one format and a checkpoint written by
either loads into either, at any world size; everything around DCP (atomic publishing, the
manifest, validation, safe unpickling, retention) lives here.

Layout and publishing
---------------------
``DIR/step_000123/`` (zero-padded to 6 digits, more when needed) holds DCP's ``__<rank>_<n>.distcp``
data files, DCP's ``.metadata`` and our ``manifest.json``. A save is written under
``DIR/.step_000123.tmp-<nonce>/``; once DCP has written ``.metadata`` (which it does only after
every rank's data files are fsynced) rank 0 writes ``manifest.json`` atomically (format version,
step, world size, config and model hashes, creation time, hpclaunch/torch versions, the caller's
``extra`` and the size and sha256 of every file) and publishes with ``os.rename`` + fsync of DIR.
A directory without a valid manifest does not exist for resume. Retention deletes by renaming to
``.step_000123.del-<nonce>`` first, so a half-deleted checkpoint never looks like a real one.

A published directory is never overwritten. Saving a step that is already published and valid is
skipped (it holds the same state: the typical case is the stop save right after a periodic save of
the same step). A published checkpoint that fails verification (on resume, before a save of its
step, or when retention meets it) is renamed ``step_N.corrupt`` and recorded in the ledger as
``checkpoint_invalid`` with the reason, so the step is saved again when the run recomputes it;
retention counts only valid checkpoints among the ``keep_last`` it keeps.

Failures
--------
Background saves are written by a writer process per rank (``checkpoint.writer: process``; see
``writer_process``) or a thread of the training process (``thread``); blocking saves always in the
training process.

A save that fails says why in the user's words on every rank ("no space left on DIR: 12.0 MiB
free, the checkpoint needs about 230.0 MiB", "permission denied: cannot write PATH"); its temporary
directory is removed. A background save that fails is noticed by every rank at the same step
(``poll_background``, called after every step); the trainer then saves again, blocking, and stops
with the reason if that fails too.

State-dict conventions (for the trainer)
----------------------------------------
``state`` is a nested dict of tensors and plain values (int, float, str, bool, None, and lists,
tuples and dicts of those). Non-tensor values are loaded with ``torch.load(weights_only=True)``,
so numpy objects are not allowed: keep RNG state as tensors or ints (``random.getstate()`` is a
tuple of ints and is fine; ``np.random.get_state()`` is not).

DCP saves a key once even when several ranks hold it (the "dedup trap"), so per-rank state must
live under a rank-unique key. The convention: everything rank-local goes under
``state[RANK_LOCAL][rank_local_key(rank)]`` (``state["rank_local"]["rank3"]``), and each rank puts
only its own entry there. Loading on a different world size tolerates missing and extra keys under
``RANK_LOCAL`` (ranks without a saved entry keep the values they came with, i.e. their fresh seeded
state; ``LoadResult.ranks_without_rank_local`` lists them); every other key must be in the
checkpoint, else loading fails with the missing keys named. Example::

    import random, torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build_state(model, optimizer, sched, step, samples, rank):
        model_sd, optim_sd = get_state_dict(model, optimizer)  # DDP/FSDP aware, FQN keys
        return {
            "model": model_sd,
            "optim": optim_sd,
            "sched": sched.state_dict(),
            "progress": {"step": torch.tensor(step), "samples": torch.tensor(samples)},
            RANK_LOCAL: {rank_local_key(rank): {
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
            }},
        }

    checkpoints = RunCheckpoints(run.checkpoints, world_size=world, config_hash=ch, model_hash=mh,
                                 keep_last=3, keep_every=1000)
    ckpt = Checkpointer(checkpoints, rank=rank, ledger=ledger)
    state = build_state(model, optimizer, sched, 0, 0, rank)
    result = ckpt.load_latest(state)            # fills `state` in place
    if result is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        step = int(state["progress"]["step"])
        if rank not in result.ranks_without_rank_local:
            mine = state[RANK_LOCAL][rank_local_key(rank)]
            torch.set_rng_state(mine["torch_rng"])
            random.setstate(mine["python_rng"])
    ...
    ckpt.save(step, build_state(model, optimizer, sched, step, samples, rank), blocking=False,
              extra={"samples_consumed": samples})

Safety
------
Nothing read from a checkpoint is unpickled with plain pickle: ``.metadata`` goes through an
allow-list unpickler (the classes DCP metadata actually contains) and non-tensor items through
``torch.load(weights_only=True)``. Anything else raises ``CheckpointError`` naming file and class.

Test hooks (``HPCLAUNCH_TEST_CKPT_*`` environment variables: a slow writer, a SIGKILL mid-save,
an injected OSError such as ENOSPC) are described in ``save_errors``.

``directory`` is torch-free (``hpclaunch status`` must not import torch); the other modules import
torch inside the functions that need it.
"""

from ...rundir.checkpoint_manifest import (
    CORRUPT_SUFFIX,
    FORMAT_VERSION,
    MANIFEST_NAME,
    METADATA_NAME,
    RANK_LOCAL,
    CheckpointInfo,
    InvalidCheckpoint,
    LoadResult,
    build_manifest,
    file_digest,
    leftover_dirs,
    newest_valid,
    published_dirs,
    rank_local_key,
    read_manifest,
    scan_checkpoints,
    step_dir_name,
    steps_to_delete,
    verify_checkpoint,
)
from .checkpointer import Checkpointer, WriterSettings
from .directory import RunCheckpoints
from .fault_hooks import ENV_DELAY_WRITE, ENV_FAIL, ENV_KILL
from .reader import load_readonly
from .safe_load import load_item_safely, load_metadata_safely

__all__ = [
    "CORRUPT_SUFFIX",
    "ENV_DELAY_WRITE",
    "ENV_FAIL",
    "ENV_KILL",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "METADATA_NAME",
    "RANK_LOCAL",
    "CheckpointInfo",
    "Checkpointer",
    "InvalidCheckpoint",
    "LoadResult",
    "RunCheckpoints",
    "WriterSettings",
    "build_manifest",
    "file_digest",
    "leftover_dirs",
    "load_item_safely",
    "load_metadata_safely",
    "load_readonly",
    "newest_valid",
    "published_dirs",
    "rank_local_key",
    "read_manifest",
    "scan_checkpoints",
    "step_dir_name",
    "steps_to_delete",
    "verify_checkpoint",
]
