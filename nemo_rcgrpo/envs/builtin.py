"""The environments that ship with the package: importing this module registers their names, of every kind.

It is the one module outside ``envs/bfcl/`` that imports BFCL's code: the rest of the package reaches an
environment only through the registry (`registry.py`: ``lookup`` and ``table`` import this module first) and the
Protocols of `envs/interfaces.py`, as it reaches a plugin's. The import contract in pyproject.toml
(``[tool.importlinter]``, checked by ``make test``) keeps it that way.
"""

from nemo_rcgrpo.envs.bfcl import plugin  # noqa: F401 - registers bfcl, bfcl_micro and BFCL's parts
