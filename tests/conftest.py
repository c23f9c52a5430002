"""Shared test set-up: a private cache folder for the default model, small checkpoints."""

from __future__ import annotations

import os
import sys
import tempfile

# Before anything imports the engine: the default model is built in a folder of this run's own,
# and Ray (in tests/serve) keeps its traffic on the loopback interface.
os.environ.setdefault("PAGEDSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="pagedserve-test-cache-"))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
try:  # Triton kernels run on CPU tensors only through its interpreter, set before its import.
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _kernel_settings_restored():
    """An engine sets the process's kernel switches from its config (kernels.settings); each
    test starts from the switches the previous one found, whatever engines it built."""
    from kernels import settings

    before = settings.current()
    yield
    settings.configure(cpu_kernels=before.cpu_kernels, packed_gemm=before.packed_gemm,
                       build_dir=before.build_dir, isa_cap=before.isa_cap,
                       clear_cap=before.isa_cap is None)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# A session that used Ray stops it before the interpreter finalizes: the cluster of a module that
# failed half-way, then the asyncio loop Serve's handles run on (a daemon thread of Ray's that
# would otherwise still be running while Python tears down its modules). Ray's core worker keeps
# native threads after ``ray.shutdown()`` (``worker.io``, ``gcs_client_io_s``); with nothing left
# for them to call back into, the interpreter then finalizes as usual, so an error raised after
# the verdict still shows and ``pytest.main()`` returns to its caller.
@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if "ray" in sys.modules:
        _stop_ray()


def _stop_ray() -> None:
    import threading

    import ray

    if ray.is_initialized():
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    router = sys.modules.get("ray.serve._private.router")
    loop = getattr(getattr(router, "SingletonThreadRouter", None), "_asyncio_loop", None)
    if loop is None or loop.is_closed():
        return
    loop.call_soon_threadsafe(loop.stop)
    for thread in threading.enumerate():
        if "_run_router_event_loop" in thread.name:
            thread.join(timeout=10)
    if not loop.is_running():
        loop.close()
    router.SingletonThreadRouter._asyncio_loop = None

