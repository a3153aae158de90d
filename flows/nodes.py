"""One node of a multi-node run, the Prefect way: the `node-agent` flow runs a node's torchrun
agent for a group of the run (stages/workers/agent.py). A run starts one `node-agent` deployment
run per other node for each group it launches (tasks/common.py `node_launcher`), on that node's
work queue (plain hosts: one process worker per host) or as its own pod (Kubernetes: the
`node_index` job variable picks the pod that hosts the rendezvous).

    prefect deployment run node-agent/<recipe> --param run_name=NAME   # by hand, once per node
"""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from unirl.stages.recipe import Recipe
from unirl.stages.runtime.storage import RunStorage
from unirl.stages.workers.agent import serve_node


@flow(name="node-agent", flow_run_name="{run_name}/node-{node_index}")
def node_agent(recipe: Recipe, run_name: str = "", group: str = "", node_index: int = 0) -> dict[str, Any]:
    """Run this host's torchrun agent in a group of run `run_name` until the group ends.

    Args:
        recipe: The run's recipe (its storage is where the group is announced).
        run_name: The run's folder name (default: the recipe's name).
        group: The group to join (default: the run's newest, waiting for one to be announced).
        node_index: Which node this is (0 hosts the rendezvous on Kubernetes); a label only on plain hosts.
    """
    run_name = run_name or recipe.name
    logger = get_run_logger()
    storage = RunStorage(recipe.storage.root, run_name, recipe.storage.options)
    code = serve_node(storage, recipe, group=group, log=logger.info)
    if code != 0:
        raise RuntimeError(f"node {node_index} of run {run_name}: its torchrun agent exited with {code} (the run names "
                           "the rank that failed; it starts a new group when rerun)")
    return {"run": run_name, "group": group, "node_index": node_index}
