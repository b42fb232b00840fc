"""The plan's container part and the one function that says how each runtime starts a command in
the image (``ContainerPlan.wrap``): the node agent starts its rank host with it, preflight its probe,
and ``render`` prints it.

What runs where (docs/design.md, "Containers"): the node agent stays on the node (it needs the
scheduler's commands, the node's checks and signals); the rank host, its forkserver and the ranks
run in the image. Every runtime here keeps them in the node's process ID namespace (podman:
``--pid=host``), so the agent signals the ranks by their pids as it does without a container, and
none of them forwards the scheduler's signals (``--sig-proxy=false``): the stop reaches the ranks
through the agent's relay. The run directory, checkpoints and data are mounted at their own paths,
so what the ranks write names paths the login node can read.
"""

from __future__ import annotations

import getpass
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ..config import RunConfig

Runtime = Literal["pyxis", "apptainer", "singularity", "podman", "charliecloud"]
EXECUTABLES: dict[str, str] = {
    "pyxis": "srun",
    "apptainer": "apptainer",
    "singularity": "singularity",
    "podman": "podman",
    "charliecloud": "ch-run",
}
# What the rendered command shows where the node's own name goes (pyxis: the step's one node), and
# where this user's node-local directory goes (``rundir.node_dir``: chosen on the node).
NODE = "NODE"
NODE_DIR = "NODE_DIR"
IN_IMAGE_TMP = "/tmp"  # the node directory's place in every image: /tmp/<its name>
# Variables hpclaunch itself sets or relies on in the ranks, passed by these prefixes where a
# runtime starts from the image's environment (podman); names: launch.env, launch.pass_env and
# container.env.
PASSED_PREFIXES = ("HPCLAUNCH_", "NCCL_", "TORCH_", "GLOO_")
PASSED_NAMES = ("CUDA_VISIBLE_DEVICES",)


class Mount(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    src: str
    dst: str
    readonly: bool = False

    def spec(self) -> str:
        return f"{self.src}:{self.dst}" + (":ro" if self.readonly else "")

    @classmethod
    def parse(cls, text: str) -> Mount:
        parts = text.split(":")
        return cls(src=parts[0], dst=parts[1] if len(parts) > 1 else parts[0], readonly=parts[2:] == ["ro"])


class ContainerPlan(BaseModel):
    """Everything the runtime's command line is made of; saved in ``plan.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    runtime: Runtime
    image: str
    image_is_path: bool
    python: str  # the image's
    command: str  # the runtime's executable
    mounts: list[Mount]
    workdir: str
    env: list[str]  # names whose node value wins over the image's (podman: the only ones passed)
    flags: list[str]
    gpus: int

    @classmethod
    def from_config(cls, cfg: RunConfig, *, env_names: list[str] | None = None) -> ContainerPlan | None:
        """None without a container. ``cfg`` is resolved (absolute paths); ``env_names``: the
        plan's environment names (default launch.env's)."""
        c = cfg.container
        if not c.enabled or c.image is None:
            return None
        run_dir = str(cfg.run_path())
        names = [*(env_names if env_names is not None else cfg.launch.env), *cfg.launch.pass_env, *c.env]
        return cls(
            runtime=c.runtime,  # type: ignore[arg-type]  # (not "none": enabled)
            image=c.image,
            image_is_path=c.image_is_path,
            python=c.python,
            command=c.command or EXECUTABLES[c.runtime],
            mounts=_mounts(cfg),
            workdir=c.workdir or run_dir,
            env=sorted(set(names)),
            flags=list(c.flags),
            gpus=cfg.scheduler.gpus_per_node,
        )

    def for_probe(self) -> ContainerPlan:
        """The same image for preflight's probe, before the run exists: only what exists is mounted
        (a runtime refuses a mount whose source is missing), started at the image's root."""
        mounts = [m for m in self.mounts if Path(m.src).exists()]
        return self.model_copy(update={"mounts": mounts, "workdir": "/"})

    @property
    def runs_outside_an_allocation(self) -> bool:
        """The runtime can start the image on the login node (pyxis exists only inside srun steps)."""
        return self.runtime != "pyxis"

    def wrap(
        self,
        argv: list[str],
        *,
        node: str = NODE,
        node_dir: str | None = NODE_DIR,
        env: Mapping[str, str] | None = None,
    ) -> list[str]:
        """``argv`` (whose program is the image's) as the runtime runs it; ``node``: this node's name;
        ``node_dir``: this user's node-local directory on the node, mounted at ``/tmp/<its name>``
        in the image (what the ranks and their agent share: ``rundir.node_dir``; None: not mounted);
        ``env``: the ranks' environment on the node, whose names a runtime that starts from the
        image's environment is given (pyxis; None: ``render``, before any node)."""
        wrapped = self if node_dir is None else self.with_mount(node_dir_mount(node_dir))
        return {
            "pyxis": wrapped._pyxis,
            "apptainer": wrapped._apptainer,
            "singularity": wrapped._apptainer,
            "podman": wrapped._podman,
            "charliecloud": wrapped._charliecloud,
        }[self.runtime](argv, node, env or {})

    def with_mount(self, mount: Mount) -> ContainerPlan:
        return self.model_copy(update={"mounts": [*self.mounts, mount]})

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """The runtime's own process environment for ``env`` (the ranks' environment on the node):
        Apptainer lets the image's environment win unless a variable comes as APPTAINERENV_NAME;
        ch-run wants USER (a cron job or a bare ``env -i`` has none)."""
        if self.runtime == "charliecloud" and "USER" not in env:
            return {**env, "USER": getpass.getuser()}  # ch-run refuses to start without it
        if self.runtime not in ("apptainer", "singularity"):
            return env
        prefix = f"{self.runtime.upper()}ENV_"
        passed = {n: v for n, v in env.items() if n in self.env or n.startswith(PASSED_PREFIXES)}
        return {**env, **{prefix + n: v for n, v in passed.items()}}

    # ---- one command line per runtime ---------------------------------------------------------------

    def passed_names(self, env: Mapping[str, str]) -> list[str]:
        """The variables whose node value must win over the image's: the plan's names, and every
        one hpclaunch sets or relies on (``PASSED_PREFIXES``, ``PASSED_NAMES``) that ``env`` has."""
        ours = [n for n in env if n.startswith(PASSED_PREFIXES) or n in PASSED_NAMES]
        return sorted({*self.env, *ours})

    def _pyxis(self, argv: list[str], node: str, env: Mapping[str, str]) -> list[str]:
        # pyxis exists only as srun's flags: the agent starts its rank host as a one-task step on
        # its own node, sharing the allocation with the agents' step (--overlap).
        out = [self.command, "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}"]
        out += ["--kill-on-bad-exit=1", "--unbuffered"]
        if self.gpus:
            out.append(f"--gpus-per-node={self.gpus}")
        out += [
            f"--container-image={self.image}",
            f"--container-mounts={','.join(m.spec() for m in self.mounts)}",
        ]
        out += [f"--container-workdir={self.workdir}", "--no-container-mount-home"]
        # enroot starts from the image's ENV, and NGC images set NCCL_ and TORCH_ variables there: a
        # name listed here takes the node's value (what the agent and the NCCL preset decided).
        names = self.passed_names(env)
        if names:
            out.append(f"--container-env={','.join(names)}")
        return [*out, *self.flags, *argv]

    def _apptainer(self, argv: list[str], node: str, env: Mapping[str, str]) -> list[str]:
        out = [self.command, "exec"]
        if self.gpus:
            out.append("--nv")
        for m in self.mounts:
            out += ["--bind", m.spec()]
        out += ["--pwd", self.workdir]
        return [*out, *self.flags, self.image, *argv]

    def _podman(self, argv: list[str], node: str, env: Mapping[str, str]) -> list[str]:
        # The node's PID, network and IPC namespaces (the agent signals the ranks by pid; NCCL and
        # gloo reach the other nodes; the memory tier and DataLoader workers use the node's
        # /dev/shm); no signal proxy (the agent relays stops itself); stdin open (the agent's
        # requests).
        out = [self.command, "run", "--rm", "-i", "--pid=host", "--network=host", "--ipc=host"]
        out.append("--sig-proxy=false")
        if self.gpus:
            out += ["--device", "nvidia.com/gpu=all"]
        for m in self.mounts:
            out += ["-v", m.spec()]
        out += ["-w", self.workdir]
        for name in [*(p + "*" for p in PASSED_PREFIXES), *PASSED_NAMES, *self.env]:
            out += ["--env", name]
        out += self.flags
        # A path is a root filesystem directory; an archive goes by its transport (oci-archive:PATH).
        image = ["--rootfs", self.image] if self.image_is_path else [self.image]
        return [*out, *image, *argv]

    def _charliecloud(self, argv: list[str], node: str, env: Mapping[str, str]) -> list[str]:
        out = [self.command]
        for m in self.mounts:  # (ch-run 0.31 binds read-write only)
            out += ["-b", f"{m.src}:{m.dst}"]
        out += ["-c", self.workdir]
        return [*out, *self.flags, self.image, "--", *argv]


def node_dir_mount(node_dir: str) -> Mount:
    """The node directory at ``/tmp/<its name>`` in the image: not its own path, since a read-only
    image (Charliecloud's) has no mount point for an arbitrary one, and every runtime can make one
    in /tmp (ch-run binds the node's $TMPDIR there, or a private tmpfs; the others make their own)."""
    return Mount(src=node_dir, dst=f"{IN_IMAGE_TMP}/{Path(node_dir).name}")


def _mounts(cfg: RunConfig) -> list[Mount]:
    """The run directory, the checkpoint directory, the data, the weights a run starts from and
    the memory tier's directory at their own paths (a script's run: the script's folder and its
    working directory instead of the built-in trainer's data), then the user's; none inside
    another."""
    own = [str(cfg.run_path()), cfg.checkpoint.dir, cfg.checkpoint.memory.dir]
    if cfg.is_script:
        own += [str(Path(str(cfg.script.path)).parent), cfg.script.workdir]
    else:
        d = cfg.data
        own += [d.token_dir, d.latent_dir, d.val_token_dir, d.val_latent_dir, cfg.train.init_from]
    mounts = [Mount(src=p, dst=p) for p in own if p and p.startswith("/")]
    mounts += [Mount.parse(m) for m in cfg.container.mounts]
    kept: list[Mount] = []
    for m in sorted(mounts, key=lambda m: (len(Path(m.dst).parts), m.dst)):
        if not any(_covers(k, m) for k in kept) and m.dst not in {k.dst for k in kept}:
            kept.append(m)
    return kept


def _covers(outer: Mount, inner: Mount) -> bool:
    """``inner`` is already in the container through ``outer`` (the same place inside, as writable)."""
    src, dst = Path(inner.src), Path(inner.dst)
    if not (src.is_relative_to(outer.src) and dst.is_relative_to(outer.dst)):
        return False
    return src.relative_to(outer.src) == dst.relative_to(outer.dst) and (inner.readonly or not outer.readonly)
