"""LoRA adapters served as models of their own: ``--lora-modules name=path``.

A request whose ``model`` is an adapter's name runs with that adapter; ``/v1/models``
lists each adapter with the base model as its ``parent``. The adapters are checked at
start-up (config and files; the weights when the first request loads them), so a bad
``--lora-modules`` entry stops the server with a message naming it. With
``--allow-runtime-lora-updating``, ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` add and remove adapters while the server runs (vLLM's
endpoints and bodies; :mod:`pagedserve.server.info`). Imports no web framework.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pagedserve.engine.errors import JSONTextError, LoRAError
from pagedserve.engine.jsonlimits import decode_json
from pagedserve.engine.lora.request import (
    LoRALimits,
    LoRARequest,
    check_adapter,
    check_lora_name,
    read_adapter_config,
)


class LoRANameError(LoRAError):
    """An adapter name that is taken, or that cannot name an adapter."""


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path``, or a JSON object ``{"name", "path", "base_model_name"?}`` (vLLM's
    two forms); a ValueError says what is wrong."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = decode_json(text, f"--lora-modules {text!r}")
        except JSONTextError as e:
            raise ValueError(str(e)) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                or not isinstance(obj.get("path"), str):  # fmt: skip
            raise ValueError(f"--lora-modules {text!r} needs string 'name' and 'path'")
        base = obj.get("base_model_name")
        return LoRAModule(obj["name"], obj["path"], base if isinstance(base, str) else None)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r} must be name=path or a JSON object")
    return LoRAModule(name, path)


class LoRAAdapters:
    """The adapters a server serves, by name."""

    def __init__(self, modules: tuple[LoRAModule, ...], model_names: tuple[str, ...],
                 limits: LoRALimits | int | None) -> None:  # fmt: skip
        """``limits``: what an adapter must fit (:attr:`engine.EngineInfo.lora`), or
        only the engine's ``max_lora_rank`` before the model is loaded (the config is
        checked, not the weights); None when LoRA is off (then no module may be given)."""
        self.model_names = model_names
        self.limits = limits
        self._ids = itertools.count(1)
        self.by_name: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        for m in modules:
            self.add(m)

    def add(self, m: LoRAModule) -> LoRARequest:
        """Check and register an adapter; a :class:`LoRAError` says why it cannot be."""
        self.check(m)
        return self.register(m)

    def check_name(self, name: str) -> None:
        """A :class:`LoRANameError` unless ``name`` can name a new adapter."""
        try:
            check_lora_name(name)
        except LoRAError as e:
            raise LoRANameError(str(e)) from None
        if name in self.model_names or name in self.by_name:
            raise LoRANameError(f"a model named {name!r} is already served")

    def check(self, m: LoRAModule) -> None:
        """Check an adapter's name, path and files (its config; with the model's limits
        its weights' names and shapes too) without registering it: the part of
        :meth:`add` that reads files, which the server runs off the event loop."""
        if self.limits is None:
            raise LoRAError(f"LoRA adapter {m.name!r} given but LoRA is off (start the "
                            "server with --enable-lora)")
        self.check_name(m.name)
        if isinstance(self.limits, int):
            read_adapter_config(m.path, self.limits)
        else:
            check_adapter(m.path, self.limits)

    def register(self, m: LoRAModule) -> LoRARequest:
        """Serve a checked adapter under its name (a :class:`LoRANameError` if the name
        was taken since the check)."""
        self.check_name(m.name)
        req = self.by_name[m.name] = LoRARequest(m.name, next(self._ids), m.path)
        self.parents[m.name] = m.base_model_name or self.model_names[0]
        return req

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving an adapter (requests running with it finish with it); the
        adapter that was served under ``name``, if any."""
        self.parents.pop(name, None)
        return self.by_name.pop(name, None)

    def card(self, name: str) -> dict:
        """What ``/v1/models`` says of an adapter beside the common fields."""
        return {"root": self.by_name[name].lora_path, "parent": self.parents[name]}
