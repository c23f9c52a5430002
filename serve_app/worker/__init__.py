"""The Worker deployment: one replica = one engine (``worker``), its tensor-parallel rank
actors (``tp_ranks``) and its start phases (``startup``). May import ``router.demand`` (the
receiving end of the Routers' reports), ``metrics``, ``config``, ``wire`` and the engine's
front door."""
