"""How an option of the shipped ``precision`` group becomes Trainer arguments, in any Hydra app.

Every option of ``lightning_comp/conf/precision`` (``fp32``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``, ``comp``)
has the same keys, ``name``, ``trainer_precision``, ``plugins`` and ``callbacks`` (``comp`` also ``plan``), and the
``_target_`` :func:`trainer_arguments`, so ``hydra.utils.instantiate(cfg.precision)`` alone turns the selected option
into the keyword arguments of ``lightning.pytorch.Trainer``::

    trainer = instantiate(cfg.trainer, **instantiate(cfg.precision))   # precision=, plugins=, callbacks=

A user's app switches ``precision=bf16-mixed`` / ``precision=comp`` on its command line without any wiring of its own
(``examples/hydra_app.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from lightning.pytorch.callbacks import Callback

from lightning_comp.errors import ConfigError

__all__ = ["TrainerArguments", "trainer_arguments"]

log = logging.getLogger(__name__)


class TrainerArguments(TypedDict):
    """Keyword arguments of ``lightning.pytorch.Trainer`` that a precision option supplies.

    Attributes:
        precision: ``Trainer(precision=...)``; ``None`` where a Precision plugin is given (Lightning refuses both).
        plugins: ``Trainer(plugins=...)``: the option's plugins (``CoMPPrecision`` for ``comp``), or ``None``.
        callbacks: ``Trainer(callbacks=...)``: the option's callbacks (``CoMPSearch`` for ``comp``), maybe empty.
    """

    precision: str | int | None
    plugins: list[Any] | None
    callbacks: list[Callback]


def trainer_arguments(
    name: str,
    trainer_precision: str | int | None = None,
    plugins: Sequence[Any] | None = None,
    callbacks: Mapping[str, Any] | None = None,
    plan: Any = None,
) -> TrainerArguments:
    """The Trainer arguments of one precision option (the ``_target_`` of every ``precision/*.yaml``).

    Hydra calls it with the option's keys, already instantiated (``plugins`` and ``callbacks`` built from their
    ``_target_`` nodes).

    Args:
        name: The option's name (``comp``, ``fp32``, ...), used in error messages.
        trainer_precision: Lightning's precision string (``"32-true"``, ``"bf16-mixed"``, ...), or ``None`` where
            ``plugins`` holds a Precision plugin.
        plugins: The Trainer plugins the option supplies, or ``None``.
        callbacks: ``name -> callback`` of the option. A ``None`` entry is a callback switched off
            (``precision.callbacks.comp_search=null``); an entry that is a plain mapping had no ``_target_`` (settings
            given with ``++`` to a callback the selected option does not define, e.g. in a multirun over
            ``precision=fp32,comp``) and is skipped with a log message.
        plan: ``comp`` only: the fixed plan its ``CoMPPrecision`` starts from (consumed through the plugin's
            ``${...plan}``); it must be ``None`` for an option without plugins, which would not use it.

    Returns:
        ``{"precision": ..., "plugins": ..., "callbacks": [...]}``, to pass as ``Trainer(**arguments)``.

    Raises:
        ConfigError: If a plugin comes with a non-null ``trainer_precision``, a plugin or a callback is still a
            config node (it has no ``_target_``), a callback entry does not build a Lightning ``Callback``,
            ``callbacks`` is not a mapping, or a ``plan`` is given to an option without plugins.
    """
    where = f"precision={name}"
    built_plugins: list[Any] | None = None
    if plugins is not None:
        if isinstance(plugins, (str, bytes)) or not isinstance(plugins, Sequence):
            raise ConfigError(f"{where}: plugins must be a list of plugin configs (with _target_) or null, got "
                              f"{plugins!r}")
        built_plugins = list(plugins)
        for index, plugin in enumerate(built_plugins):
            if plugin is None or isinstance(plugin, Mapping):
                raise ConfigError(f"{where}: plugins[{index}] must build a Lightning plugin from its _target_, got "
                                  f"{plugin!r}; give it a _target_ (e.g. lightning_comp.CoMPPrecision) or drop it")
        if not built_plugins:
            built_plugins = None
    if built_plugins and trainer_precision is not None:
        raise ConfigError(
            f"{where} supplies a plugin ({type(built_plugins[0]).__name__}), so its trainer_precision must be null "
            f"(Lightning refuses a Precision plugin together with Trainer(precision=...)), got "
            f"precision.trainer_precision={trainer_precision!r}; drop that override, or pick precision=fp32, "
            "bf16-mixed, 16-mixed or bf16-true instead"
        )
    if plan is not None and not built_plugins:
        raise ConfigError(f"{where} has no plugin to run a fixed plan, got precision.plan={plan!r}; "
                          "a fixed plan needs precision=comp")
    return {"precision": trainer_precision, "plugins": built_plugins,
            "callbacks": _callbacks(where, callbacks)}


def _callbacks(where: str, callbacks: Mapping[str, Any] | None) -> list[Callback]:
    if callbacks is None:
        return []
    if not isinstance(callbacks, Mapping):
        raise ConfigError(f"{where}: callbacks must be a mapping of name -> callback config, got "
                          f"{type(callbacks).__name__} {callbacks!r}")
    built = []
    for key, callback in callbacks.items():
        if callback is None:
            continue
        if isinstance(callback, Mapping):
            log.info("precision.callbacks.%s has no _target_ (not defined by %s); ignored", key, where)
            continue
        if not isinstance(callback, Callback):
            raise ConfigError(f"{where}: precision.callbacks.{key} must build a Lightning Callback, got "
                              f"{type(callback).__name__} {callback!r}")
        built.append(callback)
    return built
