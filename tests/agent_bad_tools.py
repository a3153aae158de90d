"""A plugin with a tool the policy cannot be told about (a parameter without a type annotation, so
no JSON schema): `unirl validate` of a recipe naming it must stop, naming the tool, the parameter
and `agent.tools` (tests/stages/tools/test_tools.py); its module still imports. A module of its
own so that the good tools' server never carries it."""
from __future__ import annotations

from unirl.stages.tools import register_tool


@register_tool("fetch_page")
def fetch_page(url) -> str:  # no annotation on `url`: its schema has no type
    """The page at a URL."""
    return str(url)
