"""The Jinja2 environment every job-script template renders with.

StrictUndefined: a missing variable is an error, never an empty string. ``finalize=quote``: every
``{{ expression }}`` is shell-quoted unless it is ``Raw`` (already shell syntax, e.g. a user's
setup line), so a value can never break out of its quotes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jinja2

from .shell import Raw, quote


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
