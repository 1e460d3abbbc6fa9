"""Hydra config tree of ``lightning_comp`` (YAML only; this file makes it an importable package).

Use it from your own Hydra app with ``hydra.searchpath: [pkg://lightning_comp.conf]`` in your primary config, then
select options of its groups (``precision``, ``model``, ``data``, ``trainer``, ``size``) in your defaults list, or
include the whole training app with ``defaults: [train, _self_]``. Load it directly with
``hydra.initialize_config_module(config_module="lightning_comp.conf", version_base="1.3")`` and
``hydra.compose("train", overrides=[...])``.
"""
