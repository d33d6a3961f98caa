import contextlib
import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from nemo_rcgrpo.envs.bfcl import BFCLSuite

# marker -> module that must be importable for the marked tests to run
OPTIONAL_BACKENDS = {"megatron": "megatron.core", "vllm": "vllm", "browser": "playwright"}
CHROMIUM = "/usr/bin/chromium"  # Debian's chromium package (`make browser`); playwright drives it, downloads nothing


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Tests of an optional backend skip, with the reason shown, where it is not installed (``gpu``: where no CUDA
    device is visible; ``browser``: where playwright or /usr/bin/chromium is missing); RCGRPO_REQUIRE=megatron,vllm
    (set by `make test`, with browser where chromium is installed; add gpu on a GPU machine) turns a missing backend
    into a failure."""
    required = {m for m in os.environ.get("RCGRPO_REQUIRE", "").split(",") if m}
    unknown = required - set(OPTIONAL_BACKENDS) - {"gpu"}
    if unknown:
        raise pytest.UsageError(f"RCGRPO_REQUIRE names unknown backends {sorted(unknown)}")
    if any("gpu" in item.keywords for item in items) and not _cuda():
        if "gpu" in required:
            raise pytest.UsageError("RCGRPO_REQUIRE=gpu but torch sees no CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="no CUDA device (marker 'gpu')"))
    for marker, module in OPTIONAL_BACKENDS.items():
        if _available(module) and (marker != "browser" or os.path.exists(CHROMIUM)):
            continue
        if marker == "browser" and _available(module):
            module = CHROMIUM
        if marker in required:
            if module == CHROMIUM:
                raise pytest.UsageError(
                    f"RCGRPO_REQUIRE=browser but {CHROMIUM} is missing: `make browser` "
                    "installs Debian's chromium (apt-get, as root)"
                )
            raise pytest.UsageError(
                f"RCGRPO_REQUIRE={marker} but {module} is not importable: run `make install` "
                f"(it installs the {'dev' if marker == 'browser' else marker} extra)"
            )
        for item in items:
            if marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=f"{module} is not installed (marker '{marker}')"))


@pytest.fixture(scope="session")
def suite() -> BFCLSuite:
    """All 800 BFCL v4 multi-turn tasks; gold replays are memoised across tests."""
    return BFCLSuite()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """Prepared data of the base category (no token statistics), shared read-only by the training tests."""
    from nemo_rcgrpo.prepare_data import PrepareDataConfig, run

    out = tmp_path_factory.mktemp("d") / "data"
    run(PrepareDataConfig(out_dir=str(out), categories=("base",), tokenizer=None, progress=False))
    return out


@pytest.fixture(scope="session")
def micro_data_dir(tmp_path_factory):
    """Prepared data of the bfcl_micro tasks (short prompts on the real BFCL classes: 1-3 calls, compact tools),
    for the RL tests whose subject is a backend rather than the BFCL v4 prompts (a few hundred tokens per
    trajectory instead of about two thousand)."""
    from nemo_rcgrpo.prepare_data import PrepareDataConfig, build

    out = tmp_path_factory.mktemp("micro") / "data"
    out.mkdir()
    build(PrepareDataConfig(task_source="bfcl_micro", tokenizer=None, progress=False), out)
    return out


ONE_FOLDER_PLUGINS = Path(__file__).resolve().parent / "data" / "plugins"
# what a run of the one_folder task source needs besides its recipe
ONE_FOLDER = [
    "plugins=[one_folder_tasks]",
    "env.task_source=one_folder",
    "logging.progress=false",
    "logging.tensorboard=false",
    "trainer.save_every=1000",
]


@contextlib.contextmanager
def one_folder_plugin_loaded():
    """The test plugin `tests/data/plugins/one_folder_tasks.py` importable by name; unregistered afterwards."""
    import nemo_rcgrpo.registry as registry

    sys.path.insert(0, str(ONE_FOLDER_PLUGINS))
    try:
        yield
    finally:
        sys.path.remove(str(ONE_FOLDER_PLUGINS))
        registry.table("task_source").pop("one_folder", None)
        registry._loaded.discard("one_folder_tasks")
        sys.modules.pop("one_folder_tasks", None)


@pytest.fixture
def one_folder_plugin():
    with one_folder_plugin_loaded():
        yield


@pytest.fixture(scope="session")
def one_folder_rctp(tmp_path_factory):
    """(data, model): the one_folder tasks prepared by prepare-data, and tiny-llama after a 100-step RCTP-FT on
    them from scratch, which solves them sometimes (about 0.2 of held-out episodes sampled with the high token).
    Shared read-only by the tests that need a policy with mixed rewards (the learning test, vLLM RL)."""
    from nemo_rcgrpo.prepare_data import PrepareDataConfig, build
    from nemo_rcgrpo.train import main

    root = tmp_path_factory.mktemp("one_folder")
    data = root / "data"
    data.mkdir()
    with one_folder_plugin_loaded():
        build(
            PrepareDataConfig(task_source="one_folder", plugins=("one_folder_tasks",), tokenizer=None, progress=False),
            data,
        )
        assert (
            main(
                [
                    "--config-name=micro_rctp",
                    "model.path=tiny-llama",
                    f"data.dir={data}",
                    f"run_dir={root / 's1'}",
                    "trainer.max_steps=100",
                    "trainer.global_batch_size=8",
                    "trainer.micro_batch_size=8",
                    "trainer.lr=3e-3",
                    "trainer.warmup_steps=5",
                    *ONE_FOLDER,
                ]
            )
            == 0
        )
    return data, root / "s1" / "hf"


def run_turns(env, task, turns):
    """Play ``turns`` (lists of calls, one step each) through a fresh per-turn episode."""
    env.reset(task)
    for calls in turns:
        if env.done:
            break
        if calls:
            env.step(list(calls))
        if not env.done:
            env.step([])
    return env


def hand_advantages(rewards, eps=1e-6):
    """GRPO advantages of one group by hand: (R_j - mean) / (unbiased std + eps)."""
    g = len(rewards)
    mean = sum(rewards) / g
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (g - 1))
    return [(r - mean) / (std + eps) for r in rewards]


def rl_batch(
    loss_mask,
    advantages,
    ref_logprobs,
    old_logprobs=None,
    sampler_logprobs=None,
    input_ids=None,
    attention_mask=None,
    first=0,
):
    """An RLMicroBatch for a loss test: tokens 0 and attention 1 unless given, sampler logprobs 0 unless given."""
    from nemo_rcgrpo.data.batch import RLMicroBatch

    mask = torch.as_tensor(loss_mask)
    return RLMicroBatch(
        torch.zeros(mask.shape, dtype=torch.long) if input_ids is None else input_ids,
        torch.ones(mask.shape, dtype=torch.long) if attention_mask is None else attention_mask,
        mask,
        advantages=torch.as_tensor(advantages),
        ref_logprobs=torch.as_tensor(ref_logprobs),
        sampler_logprobs=(torch.zeros(mask.shape) if sampler_logprobs is None else torch.as_tensor(sampler_logprobs)),
        old_logprobs=None if old_logprobs is None else torch.as_tensor(old_logprobs),
        first=first,
    )
