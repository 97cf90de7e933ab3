"""FSDP wrap policies: which modules become their own flat-parameter unit (pure, no communication).

A policy is asked bottom-up (children before parents) with the number of parameters of the module that no
descendant unit has claimed yet. The root module is always a unit for whatever parameters are left.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from abc import ABC, abstractmethod
from typing import Any, Callable

from ..nn import Module, Parameter


class WrapPolicy(ABC):
    """Decides whether ``module`` (with ``unwrapped_numel`` parameters not in a child unit) is a unit."""

    @abstractmethod
    def __call__(self, module: Module, unwrapped_numel: int) -> bool:
        """True if ``module`` becomes a unit of its own."""


@dataclass(frozen=True)
class SizeBasedPolicy(WrapPolicy):
    """Wrap a module once it holds at least ``min_num_params`` parameters not already wrapped below it."""

    min_num_params: int

    def __post_init__(self):
        if int(self.min_num_params) < 1:
            raise ValueError(f"min_num_params must be >= 1, got {self.min_num_params}")

    def __call__(self, module: Module, unwrapped_numel: int) -> bool:
        return unwrapped_numel >= self.min_num_params


@dataclass(frozen=True)
class ModuleTypePolicy(WrapPolicy):
    """Wrap every module that is an instance of one of ``types``."""

    types: tuple[type, ...]

    def __call__(self, module: Module, unwrapped_numel: int) -> bool:
        return isinstance(module, self.types)


class CallablePolicy(WrapPolicy):
    """Wrap where ``fn(module) -> bool`` says so."""

    def __init__(self, fn: Callable[[Module], bool]):
        self.fn = fn

    def __call__(self, module: Module, unwrapped_numel: int) -> bool:
        return bool(self.fn(module))


class NoWrapPolicy(WrapPolicy):
    """One unit: the whole model."""

    def __call__(self, module: Module, unwrapped_numel: int) -> bool:
        return False


def size_based_auto_wrap_policy(min_num_params: int) -> SizeBasedPolicy:
    return SizeBasedPolicy(int(min_num_params))


def as_policy(policy: Any) -> WrapPolicy:
    """None, a WrapPolicy, an int (min_num_params), a class or set/tuple/list of classes, or fn(module)->bool."""
    if policy is None:
        return NoWrapPolicy()
    if isinstance(policy, WrapPolicy):
        return policy
    if isinstance(policy, bool):
        raise TypeError("auto_wrap_policy must not be a bool")
    if isinstance(policy, int):
        return SizeBasedPolicy(policy)
    if isinstance(policy, type):
        policy = (policy,)
    if isinstance(policy, (set, frozenset, tuple, list)):
        types = tuple(policy)
        bad = [t for t in types if not (isinstance(t, type) and issubclass(t, Module))]
        if bad or not types:
            raise TypeError(f"auto_wrap_policy: a module-type policy needs Module subclasses, got {bad or 'nothing'}")
        return ModuleTypePolicy(types)
    if callable(policy):
        try:
            nargs = len(inspect.signature(policy).parameters)
        except (TypeError, ValueError):
            nargs = 1
        if nargs != 1:
            raise TypeError("auto_wrap_policy callable must take exactly one argument (the module)")
        return CallablePolicy(policy)
    raise TypeError(f"auto_wrap_policy: unsupported {type(policy).__name__}; use None, an int, classes, "
                    "a callable(module) -> bool or a WrapPolicy")


@dataclass
class UnitPlan:
    """A unit: its module, dotted name, and the (full dotted name, Parameter) pairs it owns."""

    name: str
    module: Module
    params: list[tuple[str, Parameter]]

    @property
    def numel(self) -> int:
        return sum(p.size for _, p in self.params)


def plan_units(root: Module, policy: WrapPolicy) -> list[UnitPlan]:
    """Units in post-order (children first, root last); each parameter belongs to exactly one unit.

    Raises ValueError when one Parameter object is registered in modules of two different units (tied
    weights across units cannot be sharded by one unit's flat parameter).
    """
    units: list[UnitPlan] = []
    owner: dict[int, str] = {}

    def unclaimed(prefix: str, module: Module) -> list[tuple[str, Parameter]]:
        return [(n, p) for n, p in module.named_parameters(prefix) if id(p) not in owner]

    def visit(prefix: str, module: Module, is_root: bool) -> None:
        for cname, child in module.named_children():
            visit(f"{prefix}.{cname}" if prefix else cname, child, False)
        own = unclaimed(prefix, module)
        if own and (is_root or policy(module, sum(p.size for _, p in own))):
            units.append(UnitPlan(prefix, module, own))
            for _, p in own:
                owner[id(p)] = prefix

    visit("", root, True)
    _check_no_tied(root, owner)
    return units


def _check_no_tied(root: Module, owner: dict[int, str]) -> None:
    units_of: dict[int, set[str]] = {}
    unit_names = set(owner.values())
    for mname, module in root.named_modules():
        # the unit a module's direct parameters fall in is its nearest enclosing unit
        enclosing = max((u for u in unit_names if u == "" or mname == u or mname.startswith(u + ".")), key=len,
                        default="")
        for p in module._params.values():
            units_of.setdefault(id(p), set()).add(enclosing)
    for pid, units in units_of.items():
        if len(units) > 1:
            raise ValueError(f"a Parameter is shared by modules of different FSDP units {sorted(units)}; "
                             "tied weights must live in one unit (wrap their common parent)")
