"""layout.py: a job's process counts from the layout section, the policy's model-parallel sizes and a server's
tensor parallelism, by hand; every layout that does not add up refused in one line."""

import dataclasses

import pytest

from nemo_rcgrpo.config_schema import LayoutConfig
from nemo_rcgrpo.layout import parallel_plan
from nemo_rcgrpo.utils.config import ConfigError


def _layout(**kw):
    return dataclasses.replace(LayoutConfig(), **kw)


def test_one_node_with_a_server_beside_the_trainers():
    plan = parallel_plan(_layout(gpus_per_node=8, generation_gpus=2), (2, 1, 1), server_tp=2)
    assert (plan.train_nodes, plan.train_gpus_per_node, plan.world_size) == (1, 6, 6)
    assert (plan.tp, plan.pp, plan.cp, plan.dp) == (2, 1, 1, 3)
    assert (plan.generation, plan.generation_gpus, plan.generation_tp) == ("separate", 2, 2)
    assert plan.as_dict()["world_size"] == 6 and set(plan.as_dict()) >= {"nodes", "dp", "generation_nodes"}
    assert type(plan.dp) is int  # the launchers' RCGRPO_DP=3, never 3.0


def test_context_parallelism_counts_in_the_model_parallel_group():
    plan = parallel_plan(_layout(gpus_per_node=8), (1, 2, 2), server_tp=None)
    assert (plan.pp, plan.cp, plan.dp) == (2, 2, 2)
    with pytest.raises(ConfigError, match="8 training GPUs are not a multiple of TP x PP x CP = 3 x 1 x 2"):
        parallel_plan(_layout(gpus_per_node=8), (3, 1, 2), server_tp=None)


def test_server_nodes_of_their_own_and_colocated_generation():
    plan = parallel_plan(
        _layout(nodes=4, gpus_per_node=8, generation_nodes=1, generation_gpus=8), (4, 2, 1), server_tp=4
    )
    assert (plan.train_nodes, plan.train_gpus_per_node, plan.world_size, plan.dp) == (3, 8, 24, 3)
    colocated = parallel_plan(
        _layout(nodes=2, gpus_per_node=4, generation="colocated", generation_gpus=8), (1, 1, 1), server_tp=None
    )
    assert (colocated.world_size, colocated.dp, colocated.generation_tp) == (8, 8, 1)  # an in-process generator


def test_a_run_started_by_hand_needs_only_its_world_size_to_fit():
    plan = parallel_plan(_layout(gpus_per_node=3), (2, 1, 1), server_tp=None, check_model_parallel=False)
    assert plan.world_size == 3 and plan.dp is None
    with pytest.raises(ConfigError, match=r"^3 training GPUs are not a multiple of TP x PP x CP = 2 x 1 x 1$"):
        parallel_plan(_layout(gpus_per_node=3), (2, 1, 1), server_tp=None)


@pytest.mark.parametrize(
    "layout, sizes, server_tp, message",
    [
        (dict(generation="shared"), (1, 1, 1), None, r"layout.generation='shared': choose one of \['separate', "),
        (dict(nodes=0), (1, 1, 1), None, "layout.nodes and layout.gpus_per_node must be >= 1"),
        (dict(gpus_per_node=0), (1, 1, 1), None, "layout.nodes and layout.gpus_per_node must be >= 1"),
        (dict(generation_gpus=-1), (1, 1, 1), None, "generation_gpus >= 0"),
        (dict(generation_gpus=3), (1, 1, 1), 2, "layout.generation_gpus=3 must be a multiple of generation.vllm.tp=2"),
        (dict(generation="colocated", generation_gpus=2), (1, 1, 1), 2, "layout.generation=colocated is not supported"),
        (dict(generation="colocated", generation_nodes=1, nodes=2), (1, 1, 1), None, "set generation_nodes=0"),
        (dict(generation="colocated", generation_gpus=9), (1, 1, 1), None, "exceed the job's 8 GPUs"),
        (dict(nodes=1, generation_nodes=1), (1, 1, 1), 1, "leaves no training node of layout.nodes=1"),
        (dict(nodes=2, generation_nodes=1, generation_gpus=9), (1, 1, 1), 1, "do not fit on 1 node\\(s\\) of 8 GPUs"),
        (dict(nodes=2, generation_gpus=2), (1, 1, 1), 2, "multi-node jobs with a separate server"),
        (dict(generation_gpus=8), (1, 1, 1), 1, "leave no training GPU on a 8-GPU node"),
    ],
)
def test_a_layout_that_does_not_add_up_is_one_line(layout, sizes, server_tp, message):
    with pytest.raises(ConfigError, match=message) as e:
        parallel_plan(_layout(**layout), sizes, server_tp)
    assert "\n" not in str(e.value)


def test_every_edge_that_fits_is_accepted():
    assert parallel_plan(_layout(gpus_per_node=1), (1, 1, 1), None).world_size == 1  # one GPU
    assert parallel_plan(_layout(generation_gpus=7), (1, 1, 1), 7).world_size == 1  # one training GPU left
    assert parallel_plan(_layout(nodes=2, generation_nodes=1, generation_gpus=8), (1, 1, 1), 8).world_size == 8
    assert parallel_plan(_layout(generation="colocated", generation_gpus=8), (1, 1, 1), None).world_size == 8
