"""Plugin discovery (entry points) and the registries of what plugins provide.

Built-ins register through pkv's own entry point, exactly like third-party plugins. A plugin
that fails to load is recorded with its error and skipped.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from pkv.core.hookspecs import PROJECT, PkvHookSpecs

logger = logging.getLogger("pkv.plugins")


def import_target(target: str) -> Any:
    """Import "module:attr" (a plugin's implementation, loaded only when chosen)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class AttentionBackendSpec:
    """An attention backend: where it runs, how to tell if it can, how to build it."""

    name: str
    target: str  # "module:Class", imported only when the backend is chosen
    devices: tuple[str, ...]  # device types it runs on: "cpu", "cuda"
    priority: int = 0  # higher wins in `auto`
    check: Callable[[str], list[str]] = lambda device: []  # reasons it is unusable
    description: str = ""
    # Whether it reads int8 / fp8 caches, whose rows hold codes and a scale
    # (core/layers/kv_format.py): a backend written for value rows would misread them.
    scaled_kv: bool = False

    def unusable_reasons(self, device: str, scaled_kv: bool = False) -> list[str]:
        if device not in self.devices:
            return [f"runs on {', '.join(self.devices)}, not {device}"]
        if scaled_kv and not self.scaled_kv:
            return ["reads no int8 / fp8 KV cache"]
        return self.check(device)

    def load(self) -> Any:
        return import_target(self.target)


@dataclass(frozen=True)
class WeightLoaderSpec:
    """A weight format / quantization method (a pkv.core.model_loader.quantization
    .WeightLoader)."""

    name: str
    target: str  # "module:Class" of a WeightLoader, imported only when used
    description: str = ""
    file_magic: bytes | None = None  # first bytes of the files it reads itself, if any

    def load(self) -> Any:
        return import_target(self.target)


@dataclass(frozen=True)
class GuidedDecodingSpec:
    name: str
    target: str
    description: str = ""

    def load(self) -> Any:
        return import_target(self.target)


@dataclass(frozen=True)
class ToolParserSpec:
    """A tool-call format. `markers`: strings whose presence in a chat template says the
    model writes this format (how `--tool-call-parser auto` picks)."""

    name: str
    target: str  # "module:Class" of a pkv.core.structured_output.tool_calls.ToolParser
    markers: tuple[str, ...] = ()
    description: str = ""

    def load(self) -> Any:
        return import_target(self.target)


@dataclass
class PluginInfo:
    """One discovered plugin: where it comes from and what it gave (or why it failed)."""

    name: str
    distribution: str
    version: str
    provides: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class PluginRegistry:
    attention_backends: dict[str, AttentionBackendSpec] = field(default_factory=dict)
    weight_loaders: dict[str, WeightLoaderSpec] = field(default_factory=dict)
    guided_decoding: dict[str, GuidedDecodingSpec] = field(default_factory=dict)
    tool_parsers: dict[str, ToolParserSpec] = field(default_factory=dict)
    plugins: list[PluginInfo] = field(default_factory=list)

    def usable_attention_backends(self, device: str, scaled_kv: bool = False) -> list[str]:
        return [n for n, s in self.attention_backends.items()
                if not s.unusable_reasons(device, scaled_kv)]


def discover(group: str = PROJECT) -> PluginRegistry:
    """Load every entry point of `group` and collect what the plugins register."""
    registry = PluginRegistry()
    for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
        dist = ep.dist
        info = PluginInfo(ep.name, dist.name if dist else "?", dist.version if dist else "?")
        registry.plugins.append(info)
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(PkvHookSpecs)
        try:
            pm.register(ep.load(), name=ep.name)
            _collect(pm, registry, info)
        except Exception as exc:  # a broken plugin is reported, never fatal
            info.error = f"{type(exc).__name__}: {exc}"
            logger.warning("plugin %s (%s) failed to load: %s", ep.name, info.distribution,
                           info.error)
    return registry


def _collect(pm: pluggy.PluginManager, registry: PluginRegistry, info: PluginInfo) -> None:
    for spec in _flatten(pm.hook.pkv_attention_backends()):
        registry.attention_backends[spec.name] = spec
        info.provides.append(f"attention:{spec.name}")
    for spec in _flatten(pm.hook.pkv_weight_loaders()):
        registry.weight_loaders[spec.name] = spec
        info.provides.append(f"weights:{spec.name}")
    for spec in _flatten(pm.hook.pkv_guided_decoding_backends()):
        registry.guided_decoding[spec.name] = spec
        info.provides.append(f"guided:{spec.name}")
    for spec in _flatten(pm.hook.pkv_tool_parsers()):
        registry.tool_parsers[spec.name] = spec
        info.provides.append(f"tools:{spec.name}")


def _flatten(results: list[list[Any] | None]) -> list[Any]:
    return [item for result in results for item in (result or [])]


# Preference of `auto`, per device type, among usable backends.
_AUTO_ORDER = {"cuda": ("triton", "cuda", "torch"), "cpu": ("cpu", "torch")}


def select_attention_backend(name: str, device: str,
                             registry: PluginRegistry | None = None,
                             scaled_kv: bool = False) -> Any:
    """Build the backend called `name` (or the best usable one for `auto`); `scaled_kv`:
    the cache is int8 or fp8 (rows of codes and a scale)."""
    registry = registry or discover()
    specs = registry.attention_backends
    usable = registry.usable_attention_backends(device, scaled_kv)
    if name == "auto":
        order = [n for n in _AUTO_ORDER.get(device, ()) if n in usable]
        order += sorted((n for n in usable if n not in order),
                        key=lambda n: -specs[n].priority)
        for candidate in order:
            try:
                return specs[candidate].load()()
            except Exception as exc:
                logger.warning("attention backend %s is unusable (%s); trying the next",
                               candidate, exc)
        raise ValueError(f"no usable attention backend for {device}")
    check_attention_backend(name, registry, usable)
    reasons = specs[name].unusable_reasons(device, scaled_kv)
    if reasons:
        raise ValueError(f"attention backend {name!r} is unusable here ({'; '.join(reasons)}); "
                         f"usable: {', '.join(usable) or 'none'}")
    return specs[name].load()()


def check_attention_backend(name: str, registry: PluginRegistry,
                            usable: list[str] | None = None) -> None:
    """A one-line error for a backend name no plugin registers (`auto` is always one),
    naming those usable on the device (`usable`) or else every registered one."""
    if name != "auto" and name not in registry.attention_backends:
        known = usable if usable is not None else sorted(registry.attention_backends)
        where = "usable here" if usable is not None else "registered"
        raise ValueError(f"unknown attention backend {name!r}; {where}: "
                         f"{', '.join(known) or 'none'}")


def select_guided_backend(name: str, registry: PluginRegistry | None = None) -> Any:
    """The guided-decoding backend class called `name`."""
    registry = registry or discover()
    if name not in registry.guided_decoding:
        raise ValueError(f"unknown guided decoding backend {name!r}; available: "
                         f"{', '.join(registry.guided_decoding) or 'none'}")
    return registry.guided_decoding[name].load()


# What `auto` picks when no parser's markers are in the template: the format that pkv's
# fallback tools prompt asks for.
DEFAULT_TOOL_PARSER = "hermes"


def select_tool_parser(name: str, chat_template: str | None,
                       registry: PluginRegistry | None = None) -> Any:
    """A tool parser instance: the one called `name`, or for `auto` the first (by name)
    whose markers appear in the chat template."""
    registry = registry or discover()
    specs = registry.tool_parsers
    if name == "auto":
        template = chat_template or ""
        name = next((n for n, s in sorted(specs.items())
                     if any(m in template for m in s.markers)), DEFAULT_TOOL_PARSER)
    if name not in specs:
        raise ValueError(f"unknown tool call parser {name!r}; available: "
                         f"{', '.join(sorted(specs)) or 'none'}")
    return specs[name].load()()
