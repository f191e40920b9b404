"""Own tests of pytest-dflash.

torch is imported here, once, before any pytester inline run: pytester restores sys.modules
after each inline run, and a C extension such as torch cannot be imported a second time.
httpx likewise: imported first inside an inline run and re-imported after it, its transport maps
the *old* httpcore exception classes, so a refused connection escapes as a raw httpcore error
and a server engine's health wait gives up at once instead of retrying.
"""

import contextlib

import torch  # noqa: F401

with contextlib.suppress(ImportError):  # the test extra; `pip install -e .` alone lacks it
    import httpcore  # noqa: F401  (httpx imports it lazily, inside the first client)
    import httpx  # noqa: F401
