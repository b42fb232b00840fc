"""The Jinja2 environment every job-script template renders with.

StrictUndefined: a missing variable is an error, never an empty string. ``finalize=quote``: every
``{{ expression }}`` is shell-quoted unless it is ``Raw`` (already shell syntax, e.g. a user's
setup line), so a value can never break out of its quotes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import jinja2

from .container_lines import container_lines
from .exports import job_exports
from .shell import Raw, join, quote

if TYPE_CHECKING:
    from ..rundir.plan import JobPlan


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("hpclaunch", "templates"),
        undefined=jinja2.StrictUndefined,
        finalize=quote,
        autoescape=False,  # shell, not HTML: escaping is done by ``finalize``
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["raw"] = lambda value: Raw(str(value))
    return env


def render(template: str, **context: Any) -> str:
    return environment().get_template(template).render(**context)


def render_job(template: str, plan: JobPlan, **context: Any) -> str:
    """A job script: ``template`` with what every job script shows (the header's version and config
    hash, the setup lines, the exports, the node agent's command, the container lines) and
    ``context``, what only its scheduler's does."""
    return render(
        template,
        version=plan.hpclaunch_version,
        config_hash=plan.config_hash,
        setup=plan.setup,
        exports=job_exports(plan),
        agent_cmd=Raw(join(plan.agent_argv()[:-1])),
        container=container_lines(plan),
        **context,
    )
