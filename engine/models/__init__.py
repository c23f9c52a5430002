"""Architectures by ``architectures`` in config.json (``architectures``, ``registry``), each a
short declarative file built from ``engine.layers``; reading config.json (``hf_config``,
``quant_config``, ``layer_types``, ``generation_config``) and finding a model
(``hub``, ``default_model``). May import ``engine.layers``, ``engine.core`` (for sampling
defaults) and the engine's foundations."""
