"""The reward server's bearer token from a Prefect Secret block, for `RemoteScorer(token=...)`.

Kept in tasks/ because stages/ never imports Prefect. The token is returned, never logged.
"""
from __future__ import annotations


def reward_token_from_secret(block_name: str) -> str:
    """Load the Secret block `block_name` (create it with
    `prefect block create secret` or `Secret(value=...).save(block_name)`) and return its value."""
    from prefect.blocks.system import Secret  # start-up time: prefect loads on first use, not when a recipe is read

    try:
        secret = Secret.load(block_name)
    except ValueError as exc:
        raise ValueError(
            f"no Prefect Secret block named {block_name!r}: create it with "
            f"`Secret(value=TOKEN).save({block_name!r})` or in the Prefect UI"
        ) from exc
    value = secret.get()  # type: ignore[union-attr]
    if not isinstance(value, str) or not value:
        raise ValueError(f"Prefect Secret block {block_name!r} does not hold a non-empty string token")
    return value
