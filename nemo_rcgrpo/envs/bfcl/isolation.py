"""BFCL code runs on module-level objects private to its rollout, one call at a time in the process.

BFCL's API classes read and write module globals: long-context VehicleControlAPI writes the outside temperature
into BFCL's ``LONG_WEATHER_EXTENSION`` and returns that dict, TravelAPI merges the module's credit-card and
booking dicts into its state, TradingBot hands out the module's moving-average lists, TwitterAPI.post_tweet has
one default list per process, and MathAPI sets mpmath's and decimal's process-wide precision.

`isolated(instance)` runs BFCL code of one instance (its construction, ``_load_scenario``, each call) so that
none of that is shared. Under one process-wide lock it swaps every mutable global of the modules of the class
(dicts, lists, sets, bytearrays, objects of BFCL's classes), every mutable class attribute and every mutable
default argument for the instance's private copies, runs the code, then puts BFCL's originals back and
restores the numeric state. The copies are made once per instance, from the originals (which no rollout ever
touches), and kept with it: a rollout sees its own earlier writes, as it would alone in a fresh process, and
nothing of any other rollout's. Only classes of bfcl_eval's modules are covered; another class runs under the
lock and the numeric-state restore alone.
"""

from __future__ import annotations

import copy
import decimal
import inspect
import pickle
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import mpmath

# One lock for all BFCL code in the process: the swapped globals and the numeric state are process-wide.
_BFCL_GLOBALS_LOCK = threading.Lock()
PRIVATE_ATTR = "_rollout_globals"  # where an instance keeps its private copies (not public state: leading '_')
_BFCL_PACKAGE = "bfcl_eval."


# --------------------------------------------------------------------------- numeric state

_DECIMAL_FIELDS = ("prec", "rounding", "Emin", "Emax", "capitals", "clamp")


def _numeric_state() -> tuple:
    """Everything of mpmath's and decimal's process/thread state that MathAPI can change."""
    ctx = decimal.getcontext()
    return (mpmath.mp.prec, ctx, {f: getattr(ctx, f) for f in _DECIMAL_FIELDS}, dict(ctx.flags), dict(ctx.traps))


def _restore_numeric_state(saved: tuple) -> None:
    """Restore exactly what was there: mpmath's binary precision (``prec``, which also sets ``dps``) and the
    thread's own decimal context object with its settings (an outer ``localcontext()`` keeps its object)."""
    prec, ctx, fields, flags, traps = saved
    mpmath.mp.prec = prec
    if decimal.getcontext() is not ctx:
        decimal.setcontext(ctx)
    for f, v in fields.items():
        setattr(ctx, f, v)
    ctx.flags.update(flags)
    ctx.traps.update(traps)


# --------------------------------------------------------------------------- shared objects of a class


def _is_bfcl(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").startswith(_BFCL_PACKAGE)


def _mutable(value: Any) -> bool:
    if isinstance(value, (dict, list, set, bytearray)):
        return True
    return not isinstance(value, type) and not callable(value) and _is_bfcl(type(value))


def _mutable_defaults(func: Any) -> list[str]:
    names = []
    if any(_mutable(v) for v in getattr(func, "__defaults__", None) or ()):
        names.append("__defaults__")
    if any(_mutable(v) for v in (getattr(func, "__kwdefaults__", None) or {}).values()):
        names.append("__kwdefaults__")
    return names


_DYNAMIC = frozenset({"globals", "vars", "getattr", "setattr", "eval", "exec", "__dict__"})  # names not in co_names


@dataclass
class SharedSlots:
    """Where BFCL code of one class finds process-wide mutable objects, and BFCL's originals there."""

    cls: type
    slots: tuple[tuple[Any, str], ...]  # (module, class or function; the attribute that holds the object)
    originals: tuple[Any, ...]
    blobs: tuple[bytes | None, ...]  # each original pickled once (None: not picklable, deep-copied instead)
    _needed: dict[tuple[str, ...], tuple[int, ...]] = field(default_factory=dict)

    def fresh(self, i: int) -> Any:
        """A private copy of original ``i``."""
        blob = self.blobs[i]
        return pickle.loads(blob) if blob is not None else copy.deepcopy(self.originals[i])

    def needed(self, entries: tuple[str, ...]) -> tuple[int, ...]:
        """The slots that code run from the methods ``entries`` can name: every name in their code, the code
        nested in it and the functions of the class and its modules that it names, followed to the end (all
        slots when an entry is not a plain function or the code looks names up dynamically)."""
        found = self._needed.get(entries)
        if found is not None:
            return found
        names: set[str] = set()
        todo, seen = [], set()
        for entry in entries:
            func = inspect.getattr_static(self.cls, entry, None)
            func = getattr(func, "__func__", func)
            if not inspect.isfunction(func):
                todo = None
                break
            todo.append(func)
        functions = {}  # name -> function the code can reach by that name (class attribute or module global)
        for module in {owner for owner, _ in self.slots if inspect.ismodule(owner)} | {
            sys.modules[c.__module__] for c in self.cls.__mro__ if _is_bfcl(c)
        }:
            functions.update({k: v for k, v in vars(module).items() if inspect.isfunction(v) and _is_bfcl(v)})
        for c in reversed([c for c in self.cls.__mro__ if _is_bfcl(c)]):
            functions.update(
                {
                    k: getattr(v, "__func__", v)
                    for k, v in vars(c).items()
                    if inspect.isfunction(getattr(v, "__func__", v))
                }
            )
        reached: set[Any] = set(todo or ())
        codes = [f.__code__ for f in todo or ()]
        while codes:
            code = codes.pop()
            if code in seen:
                continue
            seen.add(code)
            names.update(code.co_names)
            codes += [c for c in code.co_consts if inspect.iscode(c)]
            for name in code.co_names:
                func = functions.get(name)
                if func is not None and func not in reached:
                    reached.add(func)
                    codes.append(func.__code__)
        if todo is None or names & _DYNAMIC:
            found = tuple(range(len(self.slots)))
        else:
            found = tuple(
                i
                for i, (owner, name) in enumerate(self.slots)
                if owner in reached or not inspect.isfunction(owner) and name in names
            )
        self._needed[entries] = found
        return found


_SLOTS: dict[type, SharedSlots] = {}  # filled under the lock, once per class


def shared_slots(cls: type) -> SharedSlots:
    """The module globals, class attributes and default arguments of ``cls``'s BFCL code that are mutable."""
    found = _SLOTS.get(cls)
    if found is not None:
        return found
    classes = [c for c in cls.__mro__ if _is_bfcl(c)]
    slots: list[tuple[Any, str]] = []
    for module in dict.fromkeys(sys.modules[c.__module__] for c in classes):
        for name, value in vars(module).items():
            if not name.startswith("__") and _mutable(value):
                slots.append((module, name))
            elif inspect.isfunction(value) and _is_bfcl(value):
                slots += [(value, attr) for attr in _mutable_defaults(value)]
    for c in classes:
        for name, value in vars(c).items():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value):
                slots += [(value, attr) for attr in _mutable_defaults(value)]
            elif not name.startswith("__") and _mutable(value):
                slots.append((c, name))
    slots = list(dict.fromkeys(slots))  # a function reached twice is swapped once
    originals = tuple(getattr(owner, name) for owner, name in slots)
    blobs = []
    for value in originals:
        try:
            blobs.append(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except (pickle.PicklingError, TypeError, AttributeError):
            blobs.append(None)
    found = _SLOTS[cls] = SharedSlots(cls, tuple(slots), originals, tuple(blobs))
    return found


_NOT_COPIED = object()


@contextmanager
def isolated(instance: object, *entries: str) -> Iterator[None]:
    """Run BFCL code of ``instance`` (the methods ``entries``; all of its code when none is named) on its private
    copies of the shared objects, alone in the process. An object is copied on its first use by the instance."""
    with _BFCL_GLOBALS_LOCK:
        numeric = _numeric_state()
        shared = shared_slots(type(instance))
        needed = shared.needed(entries) if entries else tuple(range(len(shared.slots)))
        private = vars(instance).setdefault(PRIVATE_ATTR, [_NOT_COPIED] * len(shared.slots)) if needed else None
        swapped = []
        try:
            for i in needed:
                if private[i] is _NOT_COPIED:
                    private[i] = shared.fresh(i)
                owner, name = shared.slots[i]
                setattr(owner, name, private[i])
                swapped.append(i)
            yield
        finally:
            for i in swapped:
                owner, name = shared.slots[i]
                private[i] = getattr(owner, name)  # a rebinding of the name stays the rollout's own
                setattr(owner, name, shared.originals[i])
            _restore_numeric_state(numeric)
