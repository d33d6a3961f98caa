"""``env.task_source=bfcl_micro``: short, generated tasks on the real BFCL API classes (docs/environment.md).

The BFCL v4 tasks are too long and too hard for a model that trains on a CPU in minutes (SmolLM2-135M scores 0
on them after a short stage 1). This family keeps everything else real: the tasks are `BFCLTask`s on BFCL's own
``GorillaFileSystem`` and ``MathAPI`` classes, run by the same safe executor and scored by the same reward
R = R_state x R_action against a replayed ground truth, and the stage-1 data is built from them by
`rcgrpo prepare-data` with the same expert and failure trajectories. What differs: one request of one to three
calls, and a short tool list (5 file-system or 4 math tools instead of a class's 17-18), so that a compact
prompt is about 330 tokens.

The family is fixed (generated from ``SEED``; the same on every machine): 1200 training and 120 held-out tasks
over 9 kinds. Held out by wording and by parameters: each kind has two training wordings and a third that only
held-out tasks use (at least half of them); every held-out task is a (wording, parameters) pair that no
training task has. The names (8 folders, 8 files) and numbers (2-20) are shared by both sides: a model trained
from scratch learns to pick among names it has seen, it is not asked to copy strings it never saw.
Ids are ``micro_<n>``: 0-1199 train, 1200-1319 held out (`MicroSuite.split`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable

from nemo_rcgrpo.envs.bfcl.suite import BFCLSuite
from nemo_rcgrpo.envs.bfcl.tasks import BFCLTask, ToolDoc

SEED = 20261202
NUM_TRAIN, NUM_TEST = 1200, 120
FS_TOOLS = ("cd", "mkdir", "touch", "echo", "rm")
MATH_TOOLS = ("add", "subtract", "multiply", "power")

# one small pool of names for both sides (a model trained from scratch in minutes learns to pick among a few names
# it has seen, not to copy arbitrary strings); held-out tasks differ in wording and in combination (below)
_FOLDERS = {
    side: ("reports", "photos", "drafts", "backup", "music", "travel", "games", "papers") for side in ("train", "test")
}
_FILES = {side: ("todo", "summary", "plan", "ideas", "data", "notes", "agenda", "list") for side in ("train", "test")}
_WORDS = {side: ("hello world", "buy milk", "call the bank", "all done") for side in ("train", "test")}


@dataclass(frozen=True)
class _Kind:
    name: str
    api: str  # the API class
    phrasings: tuple[str, str, str]  # two for training, the third only for held-out tasks
    make: Callable[[random.Random, str], tuple[dict[str, Any], list[str], dict[str, Any]]]
    # make(rng, side) -> (values for the phrasing, ground-truth calls, the class's initial config)


def _name(rng: random.Random, pool: dict, side: str, ext: str = "") -> str:
    return rng.choice(pool[side]) + ext


def _number(rng: random.Random, side: str) -> int:
    return rng.randint(2, 20)


def _fs(contents: dict[str, Any]) -> dict[str, Any]:
    return {"root": {"workspace": {"type": "directory", "contents": contents}}}


def _file(text: str = "") -> dict[str, Any]:
    return {"type": "file", "content": text}


def _folder(**contents: Any) -> dict[str, Any]:
    return {"type": "directory", "contents": dict(contents)}


def _some_files(rng: random.Random, side: str, avoid: Iterable[str] = ()) -> dict[str, Any]:
    names = [n for n in _FILES[side] if n + ".txt" not in set(avoid)]
    return {n + ".txt": _file("") for n in rng.sample(names, 2)}


def _mkdir(rng, side):
    d = _name(rng, _FOLDERS, side)
    return {"d": d}, [f"mkdir(dir_name='{d}')"], _fs(_some_files(rng, side))


def _touch(rng, side):
    f = _name(rng, _FILES, side, ".txt")
    return {"f": f}, [f"touch(file_name='{f}')"], _fs(_some_files(rng, side, [f]))


def _cd_touch(rng, side):
    d, f = _name(rng, _FOLDERS, side), _name(rng, _FILES, side, ".txt")
    return {"d": d, "f": f}, [f"cd(folder='{d}')", f"touch(file_name='{f}')"], _fs({d: _folder()})


def _mkdir_cd_touch(rng, side):
    d, f = _name(rng, _FOLDERS, side), _name(rng, _FILES, side, ".txt")
    calls = [f"mkdir(dir_name='{d}')", f"cd(folder='{d}')", f"touch(file_name='{f}')"]
    return {"d": d, "f": f}, calls, _fs(_some_files(rng, side))


def _rm(rng, side):
    f = _name(rng, _FILES, side, ".txt")
    return {"f": f}, [f"rm(file_name='{f}')"], _fs({f: _file("old"), **_some_files(rng, side, [f])})


def _echo(rng, side):
    f, w = _name(rng, _FILES, side, ".txt"), rng.choice(_WORDS[side])
    return {"f": f, "w": w}, [f"echo(content='{w}', file_name='{f}')"], _fs(_some_files(rng, side, [f]))


def _binary(tool: str) -> Callable:
    def make(rng, side):
        a, b = _number(rng, side), _number(rng, side)
        if tool == "power":
            b = rng.randint(2, 4)
        return {"a": a, "b": b}, [f"{tool}(a={a}, b={b})" if tool != "power" else f"power(base={a}, exponent={b})"], {}

    return make


KINDS: tuple[_Kind, ...] = (
    _Kind(
        "mkdir",
        "GorillaFileSystem",
        ("Create a folder named {d}.", "Make a new directory called {d}.", "I need a directory {d}; please create it."),
        _mkdir,
    ),
    _Kind(
        "touch",
        "GorillaFileSystem",
        ("Create an empty file called {f}.", "Make a new file named {f}.", "Please add a blank file {f}."),
        _touch,
    ),
    _Kind(
        "cd_touch",
        "GorillaFileSystem",
        (
            "Go into the folder {d} and create a file named {f} there.",
            "Open the {d} folder and make an empty file {f} in it.",
            "Inside the existing folder {d}, add a new file {f}.",
        ),
        _cd_touch,
    ),
    _Kind(
        "mkdir_cd_touch",
        "GorillaFileSystem",
        (
            "Create a folder {d}, move into it and create a file {f}.",
            "Make a directory {d}, go into it, then make a file {f}.",
            "Set up a new folder {d} containing an empty file {f}.",
        ),
        _mkdir_cd_touch,
    ),
    _Kind(
        "rm",
        "GorillaFileSystem",
        ("Delete the file {f}.", "Remove {f} from the current folder.", "Get rid of the file {f}, please."),
        _rm,
    ),
    _Kind(
        "echo",
        "GorillaFileSystem",
        (
            "Write '{w}' into a new file named {f}.",
            "Put the text '{w}' in a file {f}.",
            "Save the words '{w}' to the file {f}.",
        ),
        _echo,
    ),
    _Kind(
        "add",
        "MathAPI",
        ("What is {a} plus {b}?", "Add {a} and {b}.", "Compute the sum of {a} and {b}."),
        _binary("add"),
    ),
    _Kind(
        "multiply",
        "MathAPI",
        ("What is {a} times {b}?", "Multiply {a} by {b}.", "Compute the product of {a} and {b}."),
        _binary("multiply"),
    ),
    _Kind(
        "power",
        "MathAPI",
        ("What is {a} to the power of {b}?", "Raise {a} to the power {b}.", "Compute {a} raised to the exponent {b}."),
        _binary("power"),
    ),
)


class MicroSuite(BFCLSuite):
    """The ``bfcl_micro`` tasks, with the suite interface of `BFCLSuite` (tasks, gold replays, split)."""

    title = "BFCL micro tasks"

    def _make_tasks(self, categories: tuple[str, ...]) -> list[BFCLTask]:
        return generate(self.docs) if "base" in categories else []  # every micro task is a base task

    def split(self, seed: int, test_fraction: float = 0.1):
        """The family's own split (ids below NUM_TRAIN train, the rest held out), whatever the seed and fraction."""
        from nemo_rcgrpo.envs.splits import Split

        numbers = sorted(t.scenario for t in self)
        return Split(
            SEED,
            NUM_TEST / (NUM_TRAIN + NUM_TEST),
            tuple(n for n in numbers if n < NUM_TRAIN),
            tuple(n for n in numbers if n >= NUM_TRAIN),
        )


def generate(docs: dict[str, tuple[ToolDoc, ...]]) -> list[BFCLTask]:
    """The tasks, deterministically: kinds in turn; a held-out task's parameters are a combination no training
    task of its kind has in the same wording."""
    rng = random.Random(SEED)
    offered = {"GorillaFileSystem": FS_TOOLS, "MathAPI": MATH_TOOLS}
    tasks, seen = [], set()
    for number in range(NUM_TRAIN + NUM_TEST):
        side = "train" if number < NUM_TRAIN else "test"
        kind = KINDS[number % len(KINDS)]
        if side == "train":
            index = rng.randrange(2)
            values, calls, config = kind.make(rng, side)
        else:  # half in the held-out wording; always a (wording, parameters) pair no training task has
            index = 2 if number % 2 == 0 else rng.randrange(2)
            for attempt in range(400):
                if attempt == 200:
                    index = 2  # every parameter choice of this kind is seen in training: the wording is new
                values, calls, config = kind.make(rng, side)
                if (kind.name, index, tuple(sorted(values.items()))) not in seen:
                    break
            else:
                raise RuntimeError(f"bfcl_micro: no unseen parameters left for a held-out {kind.name} task")
        if side == "train":
            seen.add((kind.name, index, tuple(sorted(values.items()))))
        phrasing = kind.phrasings[index]
        by_name = {d.name: d for d in docs[kind.api]}
        tasks.append(
            BFCLTask(
                id=f"micro_{number}",
                category="base",
                turns=((MappingProxyType({"role": "user", "content": phrasing.format(**values)}),),),
                ground_truth=(tuple(calls),),
                initial_config=MappingProxyType({kind.api: config} if config else {}),
                involved_classes=(kind.api,),
                tools=tuple(by_name[n] for n in offered[kind.api]),
            )
        )
    return tasks


def kind_of(task: BFCLTask) -> str:
    """The kind a micro task was generated from (its ids cycle through `KINDS`)."""
    return KINDS[task.scenario % len(KINDS)].name
