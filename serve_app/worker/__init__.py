"""The Worker deployment: one replica = one engine (``worker``), the engine it runs
(``serving_engine``: what it needs of one, and the default ``build_engine``), its open batch
streams (``batch_stream``: one engine step's record -> one wire message), its tensor-parallel
rank actors (``tp_ranks``) and its start phases (``startup``). May import ``router.demand``
(the receiving end of the Routers' reports), ``metrics``, ``config``, ``wire`` and the engine's
front door."""
