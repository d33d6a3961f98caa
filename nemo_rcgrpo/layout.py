"""A job's GPU layout: where the training ranks and the generation server go, and the process counts the launchers
start (`rcgrpo layout`, `nemo_rcgrpo/launch.py`; scripts/slurm/, scripts/launch_local.sh).

A pure function of the ``layout`` section, the policy's model-parallel sizes and what the generator needs of GPUs
of its own; config validation calls it (the layout must add up) and the launchers read its result, the generation
engines among it (every generation GPU in an engine of ``generation.vllm.tp`` GPUs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from nemo_rcgrpo.config_schema import LayoutConfig
from nemo_rcgrpo.utils.config import ConfigError, check_choices


@dataclass(frozen=True)
class ParallelPlan:
    """The process counts of a job (what ``rcgrpo layout`` prints as ``RCGRPO_*`` variables)."""

    nodes: int
    gpus_per_node: int
    train_nodes: int
    train_gpus_per_node: int
    world_size: int  # training ranks
    tp: int
    pp: int
    cp: int
    dp: int | None  # None where TP x PP x CP does not divide the training ranks (a run started by hand)
    generation: str
    generation_nodes: int
    generation_gpus: int
    generation_tp: int
    # the generation engines (vLLM servers of generation_tp GPUs each) that fill the generation GPUs: how many in all
    # and on each node that hosts them, that node's GPUs for them (CUDA indices), and the list as
    # "node:devices node:devices ..." (node: the index among the nodes hosting engines)
    generation_engines: int = 0
    engines_per_node: int = 0
    generation_devices: str = ""
    engines: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parallel_plan(
    layout: LayoutConfig, model_parallel: tuple[int, int, int], server_tp: int | None, check_model_parallel: bool = True
) -> ParallelPlan:
    """The job's process counts; refuses, in one line each, a layout that does not add up.

    ``model_parallel``: the policy's (TP, PP, CP) sizes ((1, 1, 1) for a backend without model parallelism).
    ``server_tp``: the tensor-parallel size of a generator that runs as a server on GPUs of its own (its GPUs must
    be a multiple of it, and it cannot share the training GPUs), None for an in-process generator.
    ``check_model_parallel``: also require TP x PP x CP to divide the training GPUs (what the launchers use; a run
    started by hand, e.g. TP=3 on a CPU, only needs its own world size to fit, which Megatron checks at start).
    """
    lay = layout
    check_choices(lay, "layout.")  # generation: a layout built in code is not checked as a config is when read
    if lay.nodes < 1 or lay.gpus_per_node < 1 or lay.generation_nodes < 0 or lay.generation_gpus < 0:
        raise ConfigError(
            "layout.nodes and layout.gpus_per_node must be >= 1, generation_nodes and generation_gpus >= 0"
        )
    if server_tp is not None and lay.generation_gpus and lay.generation_gpus % server_tp:
        raise ConfigError(
            f"layout.generation_gpus={lay.generation_gpus} must be a multiple of generation.vllm.tp={server_tp}"
        )
    if lay.generation == "colocated" and server_tp is not None:
        raise ConfigError(
            "layout.generation=colocated is not supported with generation=vllm (nothing puts the "
            "server to sleep while the trainer updates, and NCCL cannot join a trainer rank and a "
            "vLLM worker on one GPU): use layout.generation=separate with layout.generation_gpus"
        )
    if lay.generation == "colocated":
        if lay.generation_nodes:
            raise ConfigError("layout.generation=colocated shares the training GPUs: set generation_nodes=0")
        train_nodes, train_gpus = lay.nodes, lay.gpus_per_node
        if lay.generation_gpus > lay.nodes * lay.gpus_per_node:
            raise ConfigError(
                f"layout.generation_gpus={lay.generation_gpus} exceed the job's {lay.nodes * lay.gpus_per_node} GPUs"
            )
    elif lay.generation_nodes:
        train_nodes, train_gpus = lay.nodes - lay.generation_nodes, lay.gpus_per_node
        if train_nodes < 1:
            raise ConfigError(
                f"layout.generation_nodes={lay.generation_nodes} leaves no training node of layout.nodes={lay.nodes}"
            )
        if lay.generation_gpus > lay.generation_nodes * lay.gpus_per_node:
            raise ConfigError(
                f"layout.generation_gpus={lay.generation_gpus} do not fit on "
                f"{lay.generation_nodes} node(s) of {lay.gpus_per_node} GPUs"
            )
    else:
        if lay.nodes > 1 and lay.generation_gpus:
            raise ConfigError(
                "multi-node jobs with a separate server put it on its own nodes: set layout.generation_nodes"
            )
        train_nodes, train_gpus = lay.nodes, lay.gpus_per_node - lay.generation_gpus
        if train_gpus < 1:
            raise ConfigError(
                f"layout.generation_gpus={lay.generation_gpus} leave no training GPU on a {lay.gpus_per_node}-GPU node"
            )
    engines = engine_layout(lay, server_tp)
    world = train_nodes * train_gpus
    tp, pp, cp = model_parallel
    mp = tp * pp * cp
    if check_model_parallel and world % mp:
        raise ConfigError(f"{world} training GPUs are not a multiple of TP x PP x CP = {tp} x {pp} x {cp}")
    return ParallelPlan(
        nodes=lay.nodes,
        gpus_per_node=lay.gpus_per_node,
        train_nodes=train_nodes,
        train_gpus_per_node=train_gpus,
        world_size=world,
        tp=tp,
        pp=pp,
        cp=cp,
        dp=world // mp if world % mp == 0 else None,
        generation=lay.generation,
        generation_nodes=lay.generation_nodes,
        generation_gpus=lay.generation_gpus,
        generation_tp=server_tp or 1,
        **engines,
    )


def engine_layout(lay: LayoutConfig, server_tp: int | None) -> dict[str, Any]:
    """The engines of ``server_tp`` GPUs each that fill ``layout.generation_gpus``: on the last GPUs of the node
    (``generation_nodes=0``), or spread evenly over the generation nodes, from each one's first GPU."""
    if server_tp is None or not lay.generation_gpus or lay.generation == "colocated":
        return {}
    hosts = max(1, lay.generation_nodes)
    if lay.generation_gpus % (hosts * server_tp):
        raise ConfigError(
            f"layout.generation_gpus={lay.generation_gpus} must fill {hosts} generation node(s) with engines of "
            f"generation.vllm.tp={server_tp} GPUs alike: a multiple of {hosts * server_tp}"
        )
    per_node = lay.generation_gpus // hosts
    first = lay.gpus_per_node - per_node if lay.generation_nodes == 0 else 0
    gpus = list(range(first, first + per_node))
    runs = [",".join(map(str, gpus[i : i + server_tp])) for i in range(0, per_node, server_tp)]
    return {
        "generation_engines": hosts * len(runs),
        "engines_per_node": len(runs),
        "generation_devices": ",".join(map(str, gpus)),
        "engines": " ".join(f"{node}:{run}" for node in range(hosts) for run in runs),
    }
