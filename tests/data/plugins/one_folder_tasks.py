"""A user's task source, loaded by name (plugins=[one_folder_tasks], env.task_source=one_folder): one request in
several wordings, always answered by mkdir(dir_name='reports'), on BFCL's GorillaFileSystem with the tools of
bfcl_micro. A tiny model learns it from a few dozen stage-1 steps without reading the request closely, so the
effect of a handful of RL steps on held-out success shows in seconds (tests/functional/test_learning.py).

Ids one_0 .. one_23 train, one_24 .. one_35 held out: the same three wordings, and held-out tasks start from
folders (files around) that no training task has.
"""

from __future__ import annotations

import random
from types import MappingProxyType

from nemo_rcgrpo import register
from nemo_rcgrpo.envs.bfcl.micro import FS_TOOLS
from nemo_rcgrpo.envs.bfcl.suite import BFCLSuite
from nemo_rcgrpo.envs.bfcl.tasks import BFCLTask
from nemo_rcgrpo.envs.splits import Split

TRAIN, HELD_OUT = 24, 12
WORDINGS = ("Create a folder named reports.", "Make a new directory called reports.",
            "I need a directory reports; please create it.")
FILES = ("todo", "summary", "plan", "ideas", "data", "notes", "agenda", "list")


class OneFolderSuite(BFCLSuite):
    def _make_tasks(self, categories):
        if "base" not in categories:
            return []
        by_name = {d.name: d for d in self.docs["GorillaFileSystem"]}
        rng = random.Random(0)
        tasks = []
        for n in range(TRAIN + HELD_OUT):
            pool = FILES[:5] if n < TRAIN else FILES[5:]
            files = {f + ".txt": {"type": "file", "content": ""} for f in rng.sample(pool, 2)}
            text = WORDINGS[n % 3]
            tasks.append(BFCLTask(
                id=f"one_{n}", category="base",
                turns=((MappingProxyType({"role": "user", "content": text}),),),
                ground_truth=(("mkdir(dir_name='reports')",),),
                initial_config=MappingProxyType({"GorillaFileSystem": {
                    "root": {"workspace": {"type": "directory", "contents": files}}}}),
                involved_classes=("GorillaFileSystem",), tools=tuple(by_name[t] for t in FS_TOOLS)))
        return tasks

    def split(self, seed, test_fraction=0.1):
        return Split(0, HELD_OUT / (TRAIN + HELD_OUT), tuple(range(TRAIN)), tuple(range(TRAIN, TRAIN + HELD_OUT)))


@register("task_source", "one_folder")
def one_folder(categories):
    return OneFolderSuite(categories)
