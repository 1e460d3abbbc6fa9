"""Hydra config tree of ``lightning_comp``: the YAML groups, and ``CoMPSearch``'s settings as a structured config.

Importing this package registers, in Hydra's ``ConfigStore``, the config ``comp_search``: a ``CoMPSearch`` node
(``_target_``) whose fields are :class:`~lightning_comp.SearchConfig`'s, typed and with Python's defaults, so that a
YAML file names only what it overrides (``precision/comp.yaml`` does, with ``defaults: [/comp_search@...]``), and a
misspelt key or a wrongly typed value fails when Hydra composes. Its ``measurement`` is a
:class:`~lightning_comp.search.MeasurementConfig` node; the group ``precision/callbacks/comp_search/measurement``
holds the presets (``quick``, ``default``, ``thorough``): ``precision/callbacks/comp_search/measurement=thorough``.

Use the tree from your own Hydra app with ``hydra.searchpath: [pkg://lightning_comp.conf]`` in your primary config, then
select options of its groups (``precision``, ``model``, ``data``, ``trainer``, ``size``) in your defaults list, or
include the whole training app with ``defaults: [train, _self_]``. Load it directly with
``hydra.initialize_config_module(config_module="lightning_comp.conf", version_base="1.3")`` and
``hydra.compose("train", overrides=[...])``.

Every option of the ``precision`` group instantiates into the Trainer's arguments
(:func:`~lightning_comp.conf.arguments.trainer_arguments`, its ``_target_``), so an app of your own needs no wiring:
``trainer = hydra.utils.instantiate(cfg.trainer, **hydra.utils.instantiate(cfg.precision))``
(``examples/hydra_app.py``).
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from lightning_comp.conf.arguments import TrainerArguments, trainer_arguments
from lightning_comp.search.config import MEASUREMENT_PRESETS, SearchConfig

__all__ = ["TrainerArguments", "register", "trainer_arguments"]

SEARCH_TARGET = "lightning_comp.CoMPSearch"
#: The presets' group: under ``precision`` (``precision/comp.yaml`` selects one), at the node it fills.
MEASUREMENT_GROUP = "precision/callbacks/comp_search/measurement"


def _writable(node: DictConfig | ListConfig) -> None:
    """A frozen dataclass makes a read-only node: let YAML files and overrides merge into it."""
    OmegaConf.set_readonly(node, False)
    children = list(node.values()) if isinstance(node, DictConfig) else list(node)
    for child in children:
        if isinstance(child, (DictConfig, ListConfig)):
            _writable(child)


def _node(schema: type | object, target: str | None = None) -> DictConfig:
    node = OmegaConf.structured(schema)
    _writable(node)
    if target is not None:
        with open_dict(node):
            node["_target_"] = target
    return node


def register(store: ConfigStore | None = None) -> None:
    """Store ``comp_search`` (``CoMPSearch``'s settings, Python's defaults) and the measurement presets."""
    store = ConfigStore.instance() if store is None else store
    search = _node(SearchConfig, SEARCH_TARGET)
    # Empty by default, its keys are the user's: `include_dimensions={saved: [body.0]}` sets it without a `+`
    # (SearchConfig names a key that is not a dimension).
    OmegaConf.set_struct(search.include_dimensions, False)
    store.store(name="comp_search", node=search)
    for name, preset in MEASUREMENT_PRESETS.items():
        store.store(group=MEASUREMENT_GROUP, name=name, node=_node(preset))


register()
