"""Shared test set-up: a private cache folder for the default model, small checkpoints."""

from __future__ import annotations

import os
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


# Ray's core worker and gRPC keep native threads running in this process after
# ``ray.shutdown()`` (``worker.io``, ``gcs_client_io_s``, gRPC event engines) that still run
# while the interpreter finalizes. A CI run died with SIGSEGV there, after every test had passed
# and the summary was printed. The verdict is final by then, so a session that used Ray leaves
# without finalizing the interpreter, with pytest's own exit status.
_exit_status: int | None = None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    import sys

    if _exit_status is None or "ray" not in sys.modules:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
