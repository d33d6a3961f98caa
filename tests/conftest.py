import pytest

from nemo_rcgrpo.envs.bfcl import BFCLSuite


@pytest.fixture(scope="session")
def suite() -> BFCLSuite:
    """All 800 BFCL v4 multi-turn tasks; gold replays are memoised across tests."""
    return BFCLSuite()


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
