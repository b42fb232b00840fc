"""``hpclaunch nccl presets``: the NCCL presets, and what ``auto`` picks on this machine."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from .common import JsonOpt, command_group, console, print_json

nccl_app, register = command_group(
    "nccl",
    "NCCL presets and their variables.\n\nExamples:\n  hpclaunch nccl presets\n  hpclaunch nccl presets --json",
)


@nccl_app.command("presets")
def presets(as_json: JsonOpt = False) -> None:
    """List the NCCL presets (nccl.preset), their variables and when to use them.

    `auto` is resolved on each node from /sys/class/infiniband and /sys/class/net; the line below
    the table shows what it picks on this machine. Extra variables go in nccl.env (validated).

    Example: hpclaunch nccl presets --json
    """
    from ..nccl import PRESETS, detect_fabric

    auto = detect_fabric()
    if as_json:
        print_json(
            {
                "presets": [
                    {"name": p.name, "env": dict(p.env), "description": p.description, "when": p.when}
                    for p in PRESETS.values()
                ],
                "auto": auto.describe(),
            }
        )
        return
    table = Table(title="NCCL presets (nccl.preset)", title_justify="left")
    table.add_column("preset", style="bold")
    table.add_column("variables", overflow="fold")
    table.add_column("when to use", overflow="fold")
    table.add_row(
        "auto",
        "[dim]chosen on each node[/]",
        "default: efa / ib / roce / ethernet / none from what the node shows",
    )
    for p in PRESETS.values():
        variables = "\n".join(f"{k}={v}" for k, v in p.env.items()) or "[dim](none)[/]"
        table.add_row(p.name, escape(variables) if p.env else variables, escape(f"{p.when}. {p.description}"))
    console.print(table)
    env = " ".join(f"{k}={v}" for k, v in auto.env.items()) or "no variables"
    console.print(f"auto on this machine: [bold]{auto.name}[/] ({escape(env)}): {escape(auto.reason)}")
