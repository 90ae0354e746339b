"""``nn.Module`` and ``torch.optim.Optimizer`` leaves, kept as ``torch.distributed.checkpoint.state_dict`` keeps them.

The state of these leaves comes from torch's own ``get_model_state_dict`` /
``get_optimizer_state_dict`` and goes back through ``set_model_state_dict`` /
``set_optimizer_state_dict``; raydcp only flattens what they return:

- a Module at key ``model``: ``model.<fqn>`` for every parameter and buffer, by the canonical
  FQN (DDP's ``module.`` and ``torch.compile``'s ``_orig_mod.`` dropped; FSDP2 parameters are
  DTensors, so each rank saves and loads its own piece);
- an Optimizer at key ``optim``: ``optim.state.<param fqn>.<name>`` (``exp_avg``, ``step``, ...)
  and ``optim.param_groups`` (one plain value whose ``params`` list the FQNs), keyed by the
  FQNs of the Module leaf of the same state dict that holds its parameters. When its parameters
  span several Module leaves, a parameter's FQN is its key in the state dict (the Module's key,
  then the parameter's name in the Module).

Protocol (called by :func:`raydcp.state.flatten_state`, in this order):

1. :meth:`ModuleLeaves.module` for each Module met while walking the state dict: its state is
   flattened at once (``visit``) and, for a load, ``set_model_state_dict`` is queued;
2. :meth:`ModuleLeaves.optimizer` for each Optimizer: deferred, because the Module leaves that
   hold its parameters may come later in the walk; a finalizer slot is reserved where it was met,
   so Stateful objects around it still get their state back after it;
3. :meth:`ModuleLeaves.finish` once the walk is over: each optimizer is matched with its Module,
   a fresh one's state is initialised (DCP's ``_init_optim_state``: one step with zero gradients
   and zero learning rate), and its state is flattened, so a load fills every moment in place;
   the slot then runs ``set_optimizer_state_dict``. A load that raises clears that initialised
   state again (``FlatState.reverts``): the optimizer is left fresh, as it came.

Checkpoints written before this layout keep an optimizer's state by integer parameter id
(``optim.state.0.exp_avg``, ``params: [0, 1, ...]``). :func:`legacy_optimizer_renames` maps such
keys to FQNs by parameter order (the order of ``optimizer.param_groups``, the order torch numbers
them in), on the load's coordinator; the optimizer's finalizer maps the ids in ``param_groups``.
"""
from __future__ import annotations

import re
from itertools import chain
from typing import Any, Callable, Iterable, Mapping

import torch

from .errors import CheckpointError

__all__ = ["ModuleLeaves", "legacy_optimizer_renames"]

Visit = Callable[[Any, str, Callable[[Any], None]], None]


def _dsd():
    # imported on first use: torch.distributed.checkpoint takes a while to import
    from torch.distributed.checkpoint import state_dict as dsd

    return dsd


def _torch_error(fqn: str, what: str, exc: Exception) -> CheckpointError:
    return CheckpointError(f"{fqn}: torch's {what} failed: {type(exc).__name__}: {exc}")


def _noop(_value: Any) -> None:
    pass


class ModuleLeaves:
    """The Module and Optimizer leaves met while flattening one state dict (see module doc)."""

    def __init__(self, for_load: bool, finalizers: list[Callable[[], None]],
                 reverts: list[Callable[[], None]] | None = None):
        self.for_load = for_load
        self.finalizers = finalizers
        self.reverts = reverts if reverts is not None else []  # undo what a load's flattening changed
        self.modules: list[tuple[str, torch.nn.Module]] = []
        self._optimizers: list[tuple[str, torch.optim.Optimizer, list]] = []
        # optimizer key -> the FQN of each parameter, by parameter id (for integer-keyed checkpoints)
        self.param_orders: dict[str, tuple[str, ...]] = {}

    # 1. ---------------------------------------------------------------------------------------
    def module(self, fqn: str, model: torch.nn.Module, visit: Visit) -> None:
        self.modules.append((fqn, model))
        if not any(True for _ in chain(model.parameters(), model.buffers())):
            return  # no state (DCP's helpers refuse an empty model state dict)
        dsd = _dsd()
        try:
            sd = dsd.get_model_state_dict(model)
        except Exception as exc:
            raise _torch_error(fqn, "get_model_state_dict", exc) from exc
        visit(sd, fqn, _noop)
        if self.for_load:
            def load_model(model=model, sd=sd) -> None:
                try:
                    dsd.set_model_state_dict(model, sd)
                except Exception as exc:
                    raise _torch_error(fqn, "set_model_state_dict", exc) from exc
            self.finalizers.append(load_model)

    # 2. ---------------------------------------------------------------------------------------
    def optimizer(self, fqn: str, optim: torch.optim.Optimizer) -> None:
        slot: list = []
        self._optimizers.append((fqn, optim, slot))
        if self.for_load:
            self.finalizers.append(lambda: slot[0]() if slot else None)

    # 3. ---------------------------------------------------------------------------------------
    def finish(self, visit: Visit) -> None:
        for fqn, optim, slot in self._optimizers:
            model = self._model_of(fqn, optim)
            dsd = _dsd()
            if self.for_load and not optim.state:  # a load that raises leaves a fresh optimizer fresh
                self.reverts.append(lambda optim=optim: optim.state.clear())  # its state now, not this dict
            try:
                sd = dsd.get_optimizer_state_dict(model, optim)  # initialises a fresh optimizer's state
            except Exception as exc:
                raise _torch_error(fqn, "get_optimizer_state_dict", exc) from exc
            order = tuple(p for g in sd["param_groups"] for p in g["params"])
            visit(sd, fqn, _noop)
            if self.for_load:
                self.param_orders[fqn] = order
                slot.append(lambda fqn=fqn, model=model, optim=optim, sd=sd, order=order:
                            _load_optimizer(fqn, model, optim, sd, order))

    def _model_of(self, fqn: str, optim: torch.optim.Optimizer) -> torch.nn.Module:
        """The Module whose FQNs name ``optim``'s parameters (see module doc)."""
        params = [p for g in optim.param_groups for p in g["params"]]
        wanted = {id(p) for p in params}
        owners = []  # (key, module, ids of the optimizer's parameters it holds)
        for key, module in self.modules:
            held = {id(p) for p in module.parameters()} & wanted
            if held:
                owners.append((key, module, held))
        whole = [(i, k, m) for i, (k, m, held) in enumerate(owners) if held == wanted]
        if whole:  # the one nearest to the optimizer in the state dict (longest common key prefix; then the first)
            return max(whole, key=lambda ikm: (_common_parts(ikm[1], fqn), -ikm[0]))[2]
        covered = set().union(*(held for _, _, held in owners)) if owners else set()
        stray = [p for p in params if id(p) not in covered]
        if not owners:
            raise CheckpointError(
                f"{fqn}: the optimizer's parameters belong to no nn.Module in the state dict: raydcp "
                f"keys optimizer state by parameter FQN and needs the model it optimizes beside it, "
                f"e.g. {{'model': model, '{fqn.rsplit('.', 1)[-1]}': optimizer}}")
        if stray:
            shapes = ", ".join(str(list(p.shape)) for p in stray[:5])
            raise CheckpointError(
                f"{fqn}: {len(stray)} of the optimizer's {len(params)} parameters (shapes {shapes}) belong "
                f"to no nn.Module in the state dict; add the module(s) holding them to the state dict")
        return _module_tree([(k, m) for k, m, _ in owners])


def _common_parts(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def _module_tree(modules: list[tuple[str, torch.nn.Module]]) -> torch.nn.Module:
    """A container whose FQNs are the Modules' keys in the state dict, for an optimizer over several."""
    root = torch.nn.ModuleDict()
    for key, module in modules:
        parts = key.split(".")
        node = root
        for part in parts[:-1]:
            if part not in node:
                node[part] = torch.nn.ModuleDict()
            node = node[part]
            if not isinstance(node, torch.nn.ModuleDict):
                raise CheckpointError(f"{key}: an nn.Module leaf inside another one's key; give the "
                                      f"optimizer's modules keys that do not nest")
        node[parts[-1]] = module
    return root


def _load_optimizer(fqn: str, model: torch.nn.Module, optim: torch.optim.Optimizer, sd: dict,
                    order: tuple[str, ...]) -> None:
    groups = sd.get("param_groups")
    if isinstance(groups, list) and any(isinstance(p, int) for g in groups if isinstance(g, dict)
                                        for p in g.get("params", ())):
        sd["param_groups"] = _legacy_groups(fqn, groups, order)
    try:
        _dsd().set_optimizer_state_dict(model, optim, sd)
    except Exception as exc:
        raise _torch_error(fqn, "set_optimizer_state_dict", exc) from exc


def _legacy_groups(fqn: str, groups: list, order: tuple[str, ...]) -> list:
    out = []
    for g in groups:
        params = list(g.get("params", ()))
        bad = [p for p in params if not isinstance(p, int) or not 0 <= p < len(order)]
        if bad:
            raise CheckpointError(
                f"{fqn}.param_groups: the checkpoint numbers the optimizer's parameters (ids {bad[:5]} "
                f"...), and this optimizer has {len(order)} parameters; build the optimizer over the "
                f"parameters it was saved with, in the same order")
        out.append({**g, "params": [order[p] for p in params]})
    return out


_ID = re.compile(r"(\d+)\.(.+)")


def _legacy(groups: Any) -> bool:
    return isinstance(groups, list) and any(
        isinstance(g, dict) and any(isinstance(p, int) for p in g.get("params", ())) for g in groups)


def legacy_optimizer_renames(tensor_keys: Iterable[str], values: Mapping[str, Any],
                             param_orders: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """Checkpoint key -> FQN key for integer-keyed optimizer state (pure; see module doc).

    ``param_orders`` maps an optimizer's key to its parameters' FQNs by id. An optimizer's
    checkpoint state counts as integer-keyed when its ``param_groups`` list integer ids (the
    marker of the old layout: an FQN-keyed checkpoint of an ``nn.Sequential`` has keys like
    ``optim.state.0.weight.exp_avg`` too).
    """
    renames: dict[str, str] = {}
    if not param_orders:
        return renames
    keys = list(tensor_keys) + list(values)
    for prefix, order in param_orders.items():
        groups = values.get(f"{prefix}.param_groups")
        if groups is None:  # param_groups with a tensor inside flatten by index
            groups = [{"params": values.get(k)} for k in values
                      if k.startswith(f"{prefix}.param_groups.") and k.endswith(".params")]
            groups = [g for g in groups if isinstance(g["params"], list)]
        if not _legacy(groups):
            continue
        head = f"{prefix}.state."
        beyond = set()
        for key in keys:
            if key.startswith(head):
                m = _ID.fullmatch(key[len(head):])
                if m and int(m.group(1)) < len(order):
                    renames[key] = f"{head}{order[int(m.group(1))]}.{m.group(2)}"
                elif m:
                    beyond.add(int(m.group(1)))
        ids = {p for g in groups if isinstance(g, dict) for p in g.get("params", ()) if isinstance(p, int)}
        if beyond or (ids and max(ids) >= len(order)):
            raise CheckpointError(
                f"{prefix}: the checkpoint keeps this optimizer's state by parameter id (ids 0..{max(ids | beyond)}) "
                f"and the optimizer has {len(order)} parameters, so the ids cannot be mapped to FQNs; build "
                f"the optimizer over the parameters it was saved with, in the same order")
    return renames
