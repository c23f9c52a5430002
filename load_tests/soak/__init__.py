"""The soak harness: mixed traffic, bad input, overload and faults against pagedserve.

    python -m load_tests.soak --help      # from the repository root

Modules, each importing only those listed above it (no cycles):

* ``spec.py``: the shared data types (``Limits``, ``Spec``, ``Verdict``, ``References``) and
  the names of the per-request invariants;
* ``cases.py``: every kind of bad (or valid but unusual) request, with its expected status;
* ``mix.py``: the seeded request mix (``Mix``) and the loopback guard;
* ``verify.py``: judges one answer (``verify``): does it belong to its request, is an error in
  OpenAI's shape, did bad input get its 4xx;
* ``report.py``: ``Outcome``, ``Fault``, the invariants over a whole run and the table;
* ``runner.py``: the aiohttp client (``Runner``) that sends the mix and keeps the outcomes;
* ``cluster.py``: the soak's own app on a local Ray cluster (``LocalApp``), replicas to kill;
* ``faults.py``: the fault driver (kills, scale 2 -> 1 -> 2) and the recovery times;
* ``run.py``: the run (``soak``) and the command line (``main``); ``__main__.py`` calls it.

``load_tests/locustfile.py`` sends the same mix with the same checks under Locust (``spec``,
``mix``, ``verify``, ``report.workers_idle``). Importing the package imports nothing else.
"""
