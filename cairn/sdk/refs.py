"""Template references: what a node's fields may name, as Python values.

Each is a ``Ref``, a ``str`` holding the ``{{ ... }}`` template the DAG service renders
when it releases the node, so it goes wherever a string does (``args``, ``env`` values,
``input_path``, ``output_path``, an f-string): ``f"--day={param('day')}"``.
"""

from __future__ import annotations

import re


class Ref(str):
    """A ``{{ EXPRESSION }}`` template, rendered by the DAG service at release."""

    __slots__ = ()

    def __new__(cls, expression: str) -> Ref:
        return super().__new__(cls, f"{{{{ {expression} }}}}")

    @property
    def expression(self) -> str:
        """What is between the braces: ``params.day``, ``nodes.load.outputs.rows``."""
        return self[3:-3]


_PARAM = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def param(name: str) -> Ref:
    """``{{ params.NAME }}``: the run's value of a parameter (over the definition's
    default)."""
    if not _PARAM.match(name):
        raise ValueError(f"{name!r} is not a parameter name (letters, digits, _; 64 at most)")
    return Ref(f"params.{name}")


#: the run's id
RUN_ID = Ref("run.id")
#: the workflow's name
RUN_WORKFLOW = Ref("run.workflow")
#: who owns the run
RUN_OWNER = Ref("run.owner")
#: the node's own name (``NODE[I]`` in a mapped instance)
NODE_NAME = Ref("node.name")
#: the node's try: 1, then one more for each retry or clear that runs it again
NODE_TRY = Ref("node.try")
#: in a mapped node: the item this instance runs for
MAP_ITEM = Ref("map.item")
#: in a mapped node: the item's index in the list
MAP_INDEX = Ref("map.index")
#: the cron slot that started the run (empty otherwise)
FIRE_SLOT = Ref("fire.slot")
FIRE_SCHEDULE_ID = Ref("fire.schedule_id")
FIRE_BACKFILL = Ref("fire.backfill")
