"""When this process began importing serve_app: the start of a Worker's own imports, after
Ray's (``serve_app.worker.startup``'s ``imports_start``). ``serve_app/__init__`` imports this
module first, so the time is taken before anything else of the package loads."""

import time

IMPORTED_AT = time.time()
